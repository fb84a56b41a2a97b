"""speculative_config parsing (errors name the key), choices strings, tree shapes and their attention masks."""

import pytest
import torch

from tritonllm.engine.config import ConfigError, EngineConfig
from tritonllm.spec_decode.config import (
    DraftTargetConfig,
    EagleConfig,
    LookaheadConfig,
    MedusaConfig,
    NGramConfig,
    SpecConfigError,
    parse_choices,
    parse_speculative_config,
)
from tritonllm.spec_decode.tree import DraftTree, TreeTemplate, default_choices


def test_each_decoding_type_parses_into_its_config():
    assert parse_speculative_config(
        {"decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 4}
    ) == NGramConfig(3, 4)
    lookahead = parse_speculative_config(
        {"decoding_type": "Lookahead", "max_window_size": 5, "max_ngram_size": 4, "max_verification_set_size": 2}
    )
    assert lookahead == LookaheadConfig(max_window_size=5, max_ngram_size=4, max_verification_set_size=2)
    assert lookahead.max_draft_len == 3 and lookahead.max_total_draft_tokens == 3 * (5 + 2)
    medusa = parse_speculative_config(
        {
            "decoding_type": "Medusa",
            "speculative_model": "/heads",
            "medusa_choices": "{0}, {0, 0}, {1}",
            "num_medusa_heads": 2,
        }
    )
    assert isinstance(medusa, MedusaConfig) and medusa.speculative_model_dir == "/heads"
    assert medusa.medusa_choices == [(0,), (0, 0), (1,)] and medusa.max_total_draft_tokens == 3
    eagle = parse_speculative_config(
        {
            "decoding_type": "Eagle",
            "speculative_model_dir": "/e",
            "max_draft_len": 3,
            "eagle_choices": [[0], [1], [0, 0]],
        }
    )
    assert isinstance(eagle, EagleConfig) and eagle.max_total_draft_tokens == 3 and not eagle.eagle3
    assert parse_speculative_config({"decoding_type": "Eagle3", "speculative_model_dir": "/e"}).eagle3
    for name in ("DraftTarget", "Draft_Target"):
        draft = parse_speculative_config({"decoding_type": name, "speculative_model_dir": "/d", "max_draft_len": 5})
        assert draft == DraftTargetConfig(5, "/d") and draft.decoding_type == "DraftTarget"
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize(
    "raw, message",
    [
        ({}, r"speculative_config\.decoding_type is required"),
        ({"decoding_type": "Jacobi"}, r"decoding_type='Jacobi' is unknown"),
        ({"decoding_type": "NGram", "max_window_size": 3}, r"speculative_config\.max_window_size is not a NGram key"),
        ({"decoding_type": "NGram", "max_draft_len": 0}, r"speculative_config\.max_draft_len must be >= 1"),
        ({"decoding_type": "NGram", "max_draft_len": "4"}, r"speculative_config\.max_draft_len must be an integer"),
        ({"decoding_type": "NGram", "is_keep_all": "yes"}, r"speculative_config\.is_keep_all must be true or false"),
        ({"decoding_type": "Lookahead", "max_ngram_size": 1}, r"speculative_config\.max_ngram_size must be >= 2"),
        ({"decoding_type": "Lookahead", "max_draft_len": 3}, r"speculative_config\.max_draft_len is not a Lookahead"),
        ({"decoding_type": "Lookahead", "max_window_size": -1}, r"speculative_config\.max_window_size must be >= 1"),
        ({"decoding_type": "Medusa"}, r"speculative_config\.speculative_model_dir is required"),
        (
            {"decoding_type": "Medusa", "speculative_model_dir": "/h", "medusa_choices": "{0, 1}"},
            r"speculative_config\.medusa_choices: path \[0, 1\] has no parent path \[0\]",
        ),
        (
            {
                "decoding_type": "Medusa",
                "speculative_model_dir": "/h",
                "medusa_choices": "{0}, {0, 0}",
                "num_medusa_heads": 1,
            },
            r"medusa_choices: path \[0, 0\] is deeper than 1",
        ),
        (
            {
                "decoding_type": "Medusa",
                "speculative_model_dir": "/h",
                "medusa_choices": "{0}, {1}",
                "max_draft_len": 1,
            },
            r"speculative_config\.max_draft_len \(1\) is smaller than the 2",
        ),
        (
            {"decoding_type": "Eagle", "speculative_model_dir": "/e", "use_dynamic_tree": True},
            r"speculative_config\.dynamic_tree_max_topK must be >= 1",
        ),
        (
            {
                "decoding_type": "Eagle",
                "speculative_model_dir": "/e",
                "use_dynamic_tree": True,
                "dynamic_tree_max_topK": 2,
                "max_draft_len": 3,
                "max_total_draft_tokens": 7,
            },
            r"speculative_config\.max_total_draft_tokens must be in",
        ),
        (
            {
                "decoding_type": "Eagle",
                "speculative_model_dir": "/e",
                "eagle_choices": "[[0]]",
                "use_dynamic_tree": True,
            },
            r"speculative_config\.eagle_choices and use_dynamic_tree exclude each other",
        ),
        (
            {"decoding_type": "DraftTarget", "max_draft_len": 3},
            r"speculative_config\.speculative_model_dir is required",
        ),
        (
            {"decoding_type": "Medusa", "speculative_model_dir": "/h", "min_path_probability": 1.5},
            r"speculative_config\.min_path_probability must be in \[0, 1\)",
        ),
        (
            {"decoding_type": "Medusa", "speculative_model_dir": "/h", "min_path_probability": "high"},
            r"speculative_config\.min_path_probability must be a number",
        ),
    ],
)
def test_bad_configs_name_the_key(raw, message):
    with pytest.raises(SpecConfigError, match=message):
        parse_speculative_config(raw)


def test_config_errors_are_engine_config_errors():
    # spec_decode's own error type (it imports nothing of the engine) ...
    with pytest.raises(SpecConfigError, match="must be a mapping") as error:
        parse_speculative_config("NGram")
    assert isinstance(error.value, ValueError)
    # ... which the engine's config reports as its ConfigError, the message unchanged: the engine and the CLI
    # already report ConfigError cleanly, so ours is caught by the same handlers.
    with pytest.raises(ConfigError) as engine_error:
        EngineConfig.from_dict({"model": "m", "speculative_config": "NGram"})
    assert str(engine_error.value) == str(error.value)


@pytest.mark.parametrize(
    "text", ["{0, 0, 0}, {0, 1}, {0}, {0, 0}", "{{0}, {0, 0}, {0, 0, 0}, {0, 1}}", "[[0], [0, 0], [0, 0, 0], [0, 1]]"]
)
def test_choices_strings_in_the_contract_forms(text):
    assert sorted(parse_choices(text)) == [(0,), (0, 0), (0, 0, 0), (0, 1)]


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "is empty"),
        ("{0, a}", "is not a list of paths"),
        ("{0}, {0}", "lists a path twice"),
        ("{-1}", "negative rank"),
        ("{}", "non-empty list of integers"),
    ],
)
def test_bad_choices_strings(text, message):
    with pytest.raises(SpecConfigError, match=message):
        parse_choices(text, "medusa_choices")


def test_template_orders_parents_first_and_fills_from_ranked_candidates():
    template = TreeTemplate.from_choices(parse_choices("{1, 0}, {0}, {1}, {0, 0}, {0, 1}"))
    assert template.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    assert template.parents == (-1, -1, 0, 0, 1)
    assert template.depth == 2 and template.max_rank == 2
    tree = template.fill([[100, 101], [200, 201]])
    assert tree.tokens == [100, 101, 200, 201, 200]
    assert tree.depths == [1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="2 deep but only 1"):
        template.fill([[1, 2]])


def test_fill_leaves_out_nodes_whose_path_probability_is_below_the_threshold():
    template = TreeTemplate.from_choices(parse_choices("{0}, {1}, {0, 0}, {0, 1}, {1, 0}, {0, 0, 0}"))
    candidates = [[10, 11], [20, 21], [30, 31]]
    probabilities = [[0.6, 0.3], [0.5, 0.4], [0.2, 0.1]]
    # paths: (0) .6, (1) .3, (0,0) .3, (0,1) .24, (1,0) .15, (0,0,0) .06
    pruned = template.fill(candidates, probabilities, 0.25)
    assert (pruned.tokens, pruned.parents) == ([10, 11, 20], [-1, -1, 0])
    assert template.fill(candidates, probabilities, 0.7).tokens == []  # nothing likely enough: no draft
    whole = template.fill(candidates, probabilities, 0.0)
    assert whole.tokens == template.fill(candidates).tokens and len(whole) == 6
    medusa = parse_speculative_config(
        {"decoding_type": "Medusa", "speculative_model_dir": "/h", "min_path_probability": 0.2}
    )
    assert medusa.min_path_probability == 0.2


def test_tree_attention_mask_is_root_plus_ancestors():
    tree = DraftTree([10, 11, 12, 13], [-1, -1, 0, 2])  # root -> 0 -> 2 -> 3 ; root -> 1
    expected = torch.tensor(
        [
            # root n0 n1 n2 n3
            [1, 0, 0, 0, 0],  # root
            [1, 1, 0, 0, 0],  # n0
            [1, 0, 1, 0, 0],  # n1: not its sibling n0
            [1, 1, 0, 1, 0],  # n2
            [1, 1, 0, 1, 1],  # n3
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.attention_mask(), expected)
    assert tree.position_offsets() == [0, 1, 1, 2, 3]
    assert tree.path_to(3) == [0, 2, 3] and tree.children(-1) == [0, 1]


def test_chain_mask_is_causal():
    chain = DraftTree.chain([4, 5, 6])
    assert chain.is_chain
    assert torch.equal(chain.attention_mask(), torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_tree_rejects_a_child_before_its_parent():
    with pytest.raises(ValueError, match="parents must come before"):
        DraftTree([1, 2], [1, -1])


def test_default_choices_is_a_connected_tree_of_the_asked_size():
    choices = default_choices(depth=3, num_nodes=10, top_k=3)
    assert len(choices) == 10 and max(len(p) for p in choices) <= 3
    template = TreeTemplate.from_choices(choices)  # validates connectivity
    assert (0,) in choices and (0, 0) in choices and (0, 0, 0) in choices
    assert template.max_rank <= 3
