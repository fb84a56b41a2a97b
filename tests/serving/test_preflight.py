"""`tritonllm serve`'s checks of a repository before tritonserver starts: a tokenizer folder it cannot use is
named with its model, parameter and folder."""

from __future__ import annotations

import shutil

import pytest

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.deploy.preflight import PreflightError, check_repository
from tritonllm.deploy.repo import build_repo, template_dir


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    work = tmp_path_factory.mktemp("preflight")
    model = build_tiny_model(work / "model")
    return model, build_repo(model, work / "repo")


def test_a_built_repository_passes(built):
    check_repository(built[1])


def test_a_tokenizer_folder_that_lost_its_tokenizer_is_named(built, tmp_path):
    model, repo = built
    copy = shutil.copytree(repo, tmp_path / "repo")
    moved = shutil.copytree(model, tmp_path / "model")
    for config in copy.glob("*/config.pbtxt"):
        config.write_text(config.read_text().replace(str(model), str(moved)))
    (moved / "tokenizer.json").unlink()
    with pytest.raises(PreflightError) as caught:
        check_repository(copy)
    message = str(caught.value)
    assert message.startswith(f"{copy / 'preprocessing' / 'config.pbtxt'}: parameter 'tokenizer_dir' = '{moved}'")
    assert "holds no tokenizer" in message and "tritonllm repo build" in message
    shutil.rmtree(moved)
    with pytest.raises(PreflightError, match="does not exist"):
        check_repository(copy)


def test_an_unfilled_template_and_a_missing_repository(tmp_path):
    shutil.copytree(template_dir(), tmp_path / "template")
    with pytest.raises(PreflightError, match="'tokenizer_dir' is not set"):
        check_repository(tmp_path / "template")
    with pytest.raises(PreflightError, match="does not exist"):
        check_repository(tmp_path / "nothing")
