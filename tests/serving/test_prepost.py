"""The preprocessing and postprocessing models executed with a fake pb_utils (no server), and the pb plumbing."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from tritonllm import tokenizer as tok
from tritonllm.models import postprocessing, preprocessing
from tritonllm.triton import pb
from tritonllm.triton.params import ParameterError

TEXT = ["Hello world, the quick brown fox jumps over the lazy dog.", "Streaming keeps spaces: naïve café 🙂"] * 10


import fake_pb_utils as fake  # noqa: E402  (registered by conftest.py)


@pytest.fixture(autouse=True)
def pb_utils(monkeypatch):
    fake.Logger.records = []
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    return fake


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    """A small SentencePiece-style (Metaspace) byte-fallback BPE that prepends <s>, with no pad token."""
    trainer = trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=50)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.train_from_iterator(TEXT, trainer)
    data = json.loads(tokenizer.to_str())
    for byte in range(256):
        data["model"]["vocab"].setdefault(f"<0x{byte:02X}>", len(data["model"]["vocab"]))
    data["model"]["byte_fallback"] = True
    tokenizer = Tokenizer.from_str(json.dumps(data))
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    directory = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    ).save_pretrained(str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def hf(tokenizer_dir):
    return tok.load_tokenizer(tokenizer_dir).hf


def model_args(name: str, **parameters: str) -> dict:
    config = {"name": name, "parameters": {key: {"string_value": value} for key, value in parameters.items()}}
    return {"model_config": json.dumps(config), "model_name": name}


def make_pre(tokenizer_dir, **parameters):
    model = preprocessing.TritonPythonModel()
    model.initialize(model_args("preprocessing", tokenizer_dir=tokenizer_dir, **parameters))
    return model


def make_post(tokenizer_dir, **parameters):
    model = postprocessing.TritonPythonModel()
    model.initialize(model_args("postprocessing", tokenizer_dir=tokenizer_dir, **parameters))
    return model


def outputs(response) -> dict:
    assert not response.has_error(), response.error().message()
    return {tensor.name(): tensor.as_numpy() for tensor in response.output_tensors()}


def error_of(response) -> str:
    assert response.has_error() and not response.output_tensors()
    assert response.error().code() == fake.TritonError.INVALID_ARG
    return response.error().message()


def query(*texts, output_len=16, **inputs) -> "fake.InferenceRequest":
    batch = {
        "QUERY": [[text.encode()] for text in texts],
        "REQUEST_OUTPUT_LEN": np.full((len(texts), 1), output_len, dtype=np.int32),
    }
    batch.update(inputs)
    return fake.InferenceRequest(batch)


# ---------------------------------------------------------------------------------------------------------------
# pb plumbing
# ---------------------------------------------------------------------------------------------------------------


def test_input_errors_name_the_input_and_the_rule():
    request = fake.InferenceRequest({"max_tokens": np.array([[1.0]], dtype=np.float32)})
    with pytest.raises(pb.InputError, match=r"^input 'max_tokens' must be INT32, got FP32$"):
        pb.required_input(request, "max_tokens", "INT32")
    with pytest.raises(pb.InputError, match=r"^input 'text_input' is required$"):
        pb.required_input(request, "text_input", "STRING")
    assert pb.optional_input(request, "text_input") is None


def test_row_scalar_reads_b1_and_reshaped_b_inputs():
    assert pb.row_scalar(np.array([[3], [4]], dtype=np.int32), 1, "x", "int") == 4
    assert pb.row_scalar(np.array([0.5, 1.5], dtype=np.float32), 0, "x", "float") == 0.5
    assert pb.row_scalar(np.array([[True]]), 0, "x", "bool") is True
    assert pb.row_scalar(np.array([[b"caf\xc3\xa9"]], dtype=object), 0, "x", "str") == "café"
    with pytest.raises(pb.InputError, match="'x' must hold one value per batch row"):
        pb.row_scalar(np.array([[1, 2]], dtype=np.int32), 0, "x", "int")


def test_strings_must_be_utf8():
    with pytest.raises(pb.InputError, match="input 'QUERY' must be UTF-8 text"):
        pb.string_rows(np.array([[b"\xff\xfe"]], dtype=object), "QUERY")
    assert pb.string_rows(np.array([[b"a", b""], [b"b", b"c"]], dtype=object), "W") == [["a", ""], ["b", "c"]]


def test_error_response_and_logger(pb_utils):
    response = pb.error_response(pb.InputError("x", "is required"))
    assert error_of(response) == "input 'x' is required"
    pb.log("warn", "careful")
    assert pb_utils.Logger.records == [("warn", "careful")]
    assert not hasattr(pb_utils.Logger, "log_warning")  # the real stub has none either


def test_input_error_with_a_whole_message():
    error = pb.InputError("input 'stop': a request id must be provided")
    assert str(error) == "input 'stop': a request id must be provided" and error.input_name is None
    assert pb.InputError("x", "is required").input_name == "x"


def test_decoupled_sending():
    sender = fake.InferenceRequest({}).get_response_sender()
    pb.send_response(sender, fake.InferenceResponse([]))
    pb.send_final(sender, pb.error_response("request was cancelled", cancelled=True))
    assert [flags for _, flags in sender.sent] == [0, fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL]
    assert sender.sent[1][0].error().code() == fake.TritonError.CANCELLED
    with pytest.raises(fake.TritonModelException):  # nothing may follow FINAL
        pb.send_final(sender)
    flag_only = fake.InferenceRequest({}).get_response_sender()
    pb.send_final(flag_only)
    assert flag_only.sent == [(None, fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL)] and flag_only.finished


def test_output_tensor_and_string_tensor():
    assert pb.output_tensor("A", np.arange(3, dtype=np.int32)).as_numpy().tolist() == [0, 1, 2]
    strings = pb.string_tensor("OUTPUT", ["é", ""]).as_numpy()
    assert strings.dtype == object and strings.tolist() == ["é".encode(), b""]


# ---------------------------------------------------------------------------------------------------------------
# preprocessing
# ---------------------------------------------------------------------------------------------------------------


def test_preprocessing_parameters(tokenizer_dir, tmp_path):
    with pytest.raises(ParameterError, match="'tokenizer_dir' is required"):
        make_pre("${tokenizer_dir}")
    with pytest.raises(ParameterError, match="'add_special_tokens'"):
        make_pre(tokenizer_dir, add_special_tokens="maybe")
    with pytest.raises(ParameterError, match="'tokenizer_dir' = .*missing': the folder .* does not exist"):
        make_pre(str(tmp_path / "missing"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ParameterError, match="'tokenizer_dir' = .*broken': cannot load a tokenizer"):
        make_pre(str(tmp_path / "broken"))
    assert make_pre(tokenizer_dir, add_special_tokens="${add_special_tokens}").preprocessor.add_special_tokens
    assert not make_pre(tokenizer_dir, add_special_tokens="false").preprocessor.add_special_tokens


def test_preprocessing_batch_of_three(tokenizer_dir, hf):
    texts = ["Hello world", "a", "the quick brown fox jumps"]
    result = outputs(make_pre(tokenizer_dir).execute([query(*texts, output_len=7)])[0])
    expected = [hf.encode(text) for text in texts]
    end_id = hf.convert_tokens_to_ids("</s>")
    assert result["INPUT_ID"].dtype == np.int32
    assert result["INPUT_ID"].shape == (3, max(map(len, expected)))
    for row, want in zip(result["INPUT_ID"], expected):
        assert row.tolist() == want + [end_id] * (len(row) - len(want))  # right-padded with pad = eos
    assert result["REQUEST_INPUT_LEN"].tolist() == [[len(want)] for want in expected]
    assert result["REQUEST_OUTPUT_LEN"].tolist() == [[7]] * 3
    assert result["OUT_END_ID"].tolist() == [[end_id]] * 3 and result["OUT_PAD_ID"].tolist() == [[end_id]] * 3
    assert result["DECODER_INPUT_ID"].tolist() == [[end_id]] * 3
    assert result["REQUEST_DECODER_INPUT_LEN"].tolist() == [[1]] * 3
    assert result["BAD_WORDS_IDS"].shape == result["STOP_WORDS_IDS"].shape == (3, 2, 0)
    assert result["EMBEDDING_BIAS"].shape == (3, 0) and result["EMBEDDING_BIAS"].dtype == np.float32


def test_preprocessing_without_special_tokens(tokenizer_dir, hf):
    result = outputs(make_pre(tokenizer_dir, add_special_tokens="no").execute([query("Hello")])[0])
    assert result["INPUT_ID"][0].tolist() == hf.encode("Hello", add_special_tokens=False)


def test_preprocessing_words_bias_and_ids(tokenizer_dir, hf):
    request = query(
        "Hello",
        "world",
        STOP_WORDS_DICT=[[b"fox", b""], [b"", b""]],  # an HTTP "stop_words": "" is [[b""]]
        BAD_WORDS_DICT=[[b"lazy dog", b"quick"], [b"dog", b""]],
        EMBEDDING_BIAS_WORDS=[[b"fox"], [b""]],
        EMBEDDING_BIAS_WEIGHTS=np.array([[2.0], [0.0]], dtype=np.float32),
        END_ID=np.array([[5], [6]], dtype=np.int32),
        PAD_ID=np.array([[7], [8]], dtype=np.int32),
    )
    result = outputs(make_pre(tokenizer_dir).execute([request])[0])
    fox = hf.encode("fox", add_special_tokens=False)
    assert result["STOP_WORDS_IDS"].shape == (2, 2, len(fox))
    assert result["STOP_WORDS_IDS"][0].tolist() == [fox, [len(fox)] + [-1] * (len(fox) - 1)]
    assert result["STOP_WORDS_IDS"][1].tolist() == [[0] * len(fox), [-1] * len(fox)]
    lazy_dog, quick = hf.encode("lazy dog", add_special_tokens=False), hf.encode("quick", add_special_tokens=False)
    assert result["BAD_WORDS_IDS"][0, 0].tolist() == lazy_dog + quick
    assert result["BAD_WORDS_IDS"][0, 1, :2].tolist() == [len(lazy_dog), len(lazy_dog) + len(quick)]
    bias = result["EMBEDDING_BIAS"]
    assert bias.shape == (2, len(hf)) and not bias[1].any()
    assert all(bias[0, token] == 2.0 for token in hf.encode("fox"))  # with special tokens: <s> too
    assert result["OUT_END_ID"].tolist() == [[5], [6]] and result["OUT_PAD_ID"].tolist() == [[7], [8]]
    assert result["DECODER_INPUT_ID"].tolist() == [[7], [8]]


def test_preprocessing_empty_stop_words_from_http(tokenizer_dir):
    result = outputs(make_pre(tokenizer_dir).execute([query("Hi", STOP_WORDS_DICT=[[b""]], BAD_WORDS_DICT=[[b""]])])[0])
    assert result["STOP_WORDS_IDS"].shape == result["BAD_WORDS_IDS"].shape == (1, 2, 0)


BAD_PREPROCESSING_REQUESTS = [
    ({"REQUEST_OUTPUT_LEN": np.array([[4]], dtype=np.int32)}, "input 'QUERY' is required"),
    (
        {"QUERY": [[b"hi"]], "REQUEST_OUTPUT_LEN": np.array([[4.0]], dtype=np.float32)},
        "input 'REQUEST_OUTPUT_LEN' must be INT32, got FP32",
    ),
    ({"QUERY": [[b"hi"]]}, "input 'REQUEST_OUTPUT_LEN' is required"),
    (
        {"QUERY": np.array([[b"\xc3("]], dtype=object), "REQUEST_OUTPUT_LEN": np.array([[4]], dtype=np.int32)},
        "input 'QUERY' must be UTF-8",
    ),
    (
        {
            "QUERY": [[b"hi"]],
            "REQUEST_OUTPUT_LEN": np.array([[4]], dtype=np.int32),
            "EMBEDDING_BIAS_WORDS": [[b"a", b"b"]],
            "EMBEDDING_BIAS_WEIGHTS": np.array([[1.0]], dtype=np.float32),
        },
        "'EMBEDDING_BIAS_WORDS' and 'EMBEDDING_BIAS_WEIGHTS' must have the same length",
    ),
    (
        {"QUERY": [[b"hi"]], "REQUEST_OUTPUT_LEN": np.array([[4]], dtype=np.int32), "DECODER_QUERY": [[b"x"]]},
        "input 'DECODER_QUERY' is not supported",
    ),
    (
        {"QUERY": [[b"hi"]], "REQUEST_OUTPUT_LEN": np.array([[4]], dtype=np.int32), "IMAGE_URL": [[b"http://x"]]},
        "input 'IMAGE_URL' is not supported: multimodal",
    ),
    (
        {
            "QUERY": [[b"hi"]],
            "REQUEST_OUTPUT_LEN": np.array([[4]], dtype=np.int32),
            "PROMPT_TABLE_EXTRA_ID": np.array([[1]], dtype=np.uint64),
        },
        "input 'PROMPT_TABLE_EXTRA_ID' is not supported",
    ),
    (
        {"QUERY": [[b"hi"], [b"ho"]], "REQUEST_OUTPUT_LEN": np.array([[4]], dtype=np.int32)},
        "input 'REQUEST_OUTPUT_LEN' must have batch size 2",
    ),
]


@pytest.mark.parametrize("inputs, message", BAD_PREPROCESSING_REQUESTS, ids=[m for _, m in BAD_PREPROCESSING_REQUESTS])
def test_preprocessing_bad_request_does_not_disturb_the_batch(tokenizer_dir, hf, inputs, message):
    model = make_pre(tokenizer_dir)
    responses = model.execute([query("before"), fake.InferenceRequest(inputs), query("after")])
    assert len(responses) == 3
    assert message in error_of(responses[1])
    assert outputs(responses[0])["INPUT_ID"][0].tolist() == hf.encode("before")
    assert outputs(responses[2])["INPUT_ID"][0].tolist() == hf.encode("after")


def test_preprocessing_unexpected_failure_is_answered_and_logged(tokenizer_dir, monkeypatch, pb_utils):
    model = make_pre(tokenizer_dir)
    monkeypatch.setattr(preprocessing.tok, "encode_prompts", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    response = model.execute([query("x")])[0]
    assert response.has_error() and "boom" in response.error().message()
    assert pb_utils.Logger.records and pb_utils.Logger.records[0][0] == "error"


# ---------------------------------------------------------------------------------------------------------------
# postprocessing
# ---------------------------------------------------------------------------------------------------------------


def tokens_request(rows, width=None, prefix=None, is_final=None):
    """rows[b][beam] = token list; TOKENS_BATCH padded with -1 like tensorrt_llm's output_ids."""
    width = width or max(len(seq) for beams in rows for seq in beams)
    tokens = np.full((len(rows), len(rows[0]), width), -1, dtype=np.int32)
    lengths = np.zeros((len(rows), len(rows[0])), dtype=np.int32)
    for b, beams in enumerate(rows):
        for beam, seq in enumerate(beams):
            tokens[b, beam, : len(seq)] = seq
            lengths[b, beam] = len(seq)
    inputs = {"TOKENS_BATCH": tokens, "SEQUENCE_LENGTH": lengths}
    if prefix is not None:
        inputs["PREFIX_IDS"] = prefix
    if is_final is not None:
        inputs["IS_FINAL"] = np.array([[flag] for flag in is_final], dtype=bool)
    return fake.InferenceRequest(inputs)


def test_postprocessing_decodes_whole_sequences_per_beam(tokenizer_dir, hf):
    texts = [["Hello world", "lazy dog"], ["naïve café 🙂", "fox"]]
    rows = [[hf.encode(text, add_special_tokens=True) for text in beams] for beams in texts]
    result = outputs(make_post(tokenizer_dir).execute([tokens_request(rows)])[0])
    assert result["OUTPUT"].dtype == object and result["OUTPUT"].shape == (4,)
    assert [value.decode() for value in result["OUTPUT"]] == [t for beams in texts for t in beams]


def test_postprocessing_keeps_special_tokens_when_asked(tokenizer_dir, hf):
    ids = hf.encode("Hello", add_special_tokens=True)
    result = outputs(make_post(tokenizer_dir, skip_special_tokens="false").execute([tokens_request([[ids]])])[0])
    assert result["OUTPUT"][0].decode() == hf.decode(ids, skip_special_tokens=False)


def stream_through_postprocessing(model, ids, chunk, k=tok.DETOKENIZE_PREFIX_TOKENS):
    """Send `ids` chunk by chunk with PREFIX_IDS left-padded with -1 to width k, as tensorrt_llm would."""
    deltas = []
    for start in range(0, len(ids), chunk):
        new = ids[start : start + chunk]
        window = tok.prefix_window(ids[: start + len(new)], len(new), k)
        prefix = np.array([[[-1] * (k - len(window)) + window]], dtype=np.int32)
        last = start + chunk >= len(ids)
        response = model.execute([tokens_request([[new]], prefix=prefix, is_final=[last])])[0]
        deltas.append(outputs(response)["OUTPUT"][0].decode())
    return deltas


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_postprocessing_streams_deltas_with_prefix_ids(tokenizer_dir, hf, chunk):
    text = "Streaming keeps spaces: naïve café 🙂 中文 ok"
    ids = hf.encode(text, add_special_tokens=False)
    deltas = stream_through_postprocessing(make_post(tokenizer_dir), ids, chunk)
    assert "".join(deltas) == hf.decode(ids) == text
    assert not any("\ufffd" in delta for delta in deltas)
    assert any(delta.startswith(" ") for delta in deltas)  # the spaces a leading ▁ stands for survive


def test_postprocessing_mixed_streaming_and_whole_requests(tokenizer_dir, hf):
    ids = hf.encode("Hello world", add_special_tokens=False)
    model = make_post(tokenizer_dir)
    streaming = tokens_request([[ids[2:]]], prefix=np.array([[[-1] * 6 + ids[:2]]], dtype=np.int32), is_final=[False])
    responses = model.execute([tokens_request([[ids]]), streaming])
    assert outputs(responses[0])["OUTPUT"][0].decode() == "Hello world"
    assert outputs(responses[1])["OUTPUT"][0].decode() == hf.decode(ids)[len(hf.decode(ids[:2])) :]


BAD_POSTPROCESSING_REQUESTS = [
    ({"SEQUENCE_LENGTH": np.array([[1]], dtype=np.int32)}, "input 'TOKENS_BATCH' is required"),
    (
        {"TOKENS_BATCH": np.array([[[5]]], dtype=np.int64), "SEQUENCE_LENGTH": np.array([[1]], dtype=np.int32)},
        "input 'TOKENS_BATCH' must be INT32, got INT64",
    ),
    (
        {"TOKENS_BATCH": np.array([[[5]]], dtype=np.int32), "SEQUENCE_LENGTH": np.array([[2]], dtype=np.int32)},
        "input 'SEQUENCE_LENGTH' must be between 0 and 1",
    ),
    (
        {"TOKENS_BATCH": np.array([[[5]]], dtype=np.int32), "SEQUENCE_LENGTH": np.array([1], dtype=np.int32)},
        "input 'SEQUENCE_LENGTH' must have shape [1, 1]",
    ),
    (
        {"TOKENS_BATCH": np.array([[[-1]]], dtype=np.int32), "SEQUENCE_LENGTH": np.array([[1]], dtype=np.int32)},
        "input 'TOKENS_BATCH' must not hold negative token ids",
    ),
    (
        {
            "TOKENS_BATCH": np.array([[[5]]], dtype=np.int32),
            "SEQUENCE_LENGTH": np.array([[1]], dtype=np.int32),
            "PREFIX_IDS": np.array([[4]], dtype=np.int32),
        },
        "input 'PREFIX_IDS' must have shape",
    ),
]


@pytest.mark.parametrize(
    "inputs, message", BAD_POSTPROCESSING_REQUESTS, ids=[m for _, m in BAD_POSTPROCESSING_REQUESTS]
)
def test_postprocessing_bad_request_does_not_disturb_the_batch(tokenizer_dir, hf, inputs, message):
    ids = hf.encode("fine", add_special_tokens=False)
    responses = make_post(tokenizer_dir).execute(
        [tokens_request([[ids]]), fake.InferenceRequest(inputs), tokens_request([[ids]])]
    )
    assert message in error_of(responses[1])
    assert outputs(responses[0])["OUTPUT"][0] == outputs(responses[2])["OUTPUT"][0] == b"fine"


def test_postprocessing_requires_tokenizer_dir():
    with pytest.raises(ParameterError, match="postprocessing: parameter 'tokenizer_dir' is required"):
        make_post("")
