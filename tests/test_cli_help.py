"""Every subcommand and every option of `tritonllm` says what it does in --help."""

from __future__ import annotations

import argparse
from typing import Iterator

from tritonllm.commands.main import build_parser


def _undocumented(parser: argparse.ArgumentParser, path: str) -> Iterator[str]:
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            documented = {choice.dest for choice in action._choices_actions if choice.help}
            for name, sub in action.choices.items():
                if name not in documented:
                    yield f"{path} {name} (the subcommand)"
                yield from _undocumented(sub, f"{path} {name}")
        elif not (action.help or "").strip():  # argparse.SUPPRESS (hidden on purpose) counts as help
            yield f"{path} {'/'.join(action.option_strings) or action.dest}"


def test_every_option_of_every_subcommand_has_help():
    missing = list(_undocumented(build_parser(), "tritonllm"))
    assert not missing, "options without help text:\n  " + "\n  ".join(missing)


def test_the_walk_finds_an_option_without_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub.choices["serve"].add_argument("--undocumented")
    sub.add_parser("bare")
    assert set(_undocumented(parser, "tritonllm")) == {
        "tritonllm serve --undocumented",
        "tritonllm bare (the subcommand)",
    }
