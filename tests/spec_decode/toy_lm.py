"""A toy language model that checks what it is shown: every query token must see exactly the positions 0..p of
one coherent sequence (committed context plus the new tokens its mask row allows), else it fails the test. Its
greedy next token is a fixed function of the last three visible tokens, which makes repeated phrases likely, so
n-gram pools and Jacobi windows find accepted drafts."""

import torch

VOCAB = 23


def next_token(sequence) -> int:
    a, b, c = ([0, 0, 0] + list(sequence))[-3:]
    return (5 * c + 3 * b + a * a + 1) % VOCAB if c % 4 else (c + 7) % VOCAB


def visible_sequence(context, new_tokens, positions, mask, row):
    seen = {p: t for p, t in enumerate(context)}
    for column in torch.nonzero(mask[row]).flatten().tolist():
        position = positions[column]
        assert position not in seen, f"row {row} sees position {position} twice"
        seen[position] = new_tokens[column]
    assert sorted(seen) == list(range(positions[row] + 1)), f"row {row} sees positions {sorted(seen)}"
    return [seen[p] for p in range(positions[row] + 1)]


def toy_forward(context, new_tokens, positions, mask):
    assert mask.shape == (len(new_tokens), len(new_tokens))
    logits = torch.zeros(len(new_tokens), VOCAB)
    for row in range(len(new_tokens)):
        assert mask[row, row], f"row {row} does not see itself"
        logits[row, next_token(visible_sequence(context, new_tokens, positions, mask, row))] = 1.0
    return logits


def greedy_reference(prompt, max_new_tokens):
    sequence = list(prompt)
    for _ in range(max_new_tokens):
        sequence.append(next_token(sequence))
    return sequence[len(prompt) :]
