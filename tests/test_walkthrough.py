"""``qkv.walkthrough``, the library behind ``qkv explain`` (STYLE.md 16): the seeds' worked
numbers from its own import path, and the names ``qkv.cli.explain`` held before the move."""

import importlib
import math
import pickle

import torch

from qkv.walkthrough import Problem, example_problem, multi_head, single_head

F64 = torch.float64
CLI_ONLY = {"add_parser", "run_explain"}


def test_seed000_one_head_closed_form():
    """Seed 000, scale 1/sqrt(2): row 1's scores are [1/sqrt(2), sqrt(2)], W_V = I."""
    walk = single_head(example_problem("seed000"))
    a = math.exp(1 / math.sqrt(2))  # e^(sqrt(2) - 1/sqrt(2))
    want = torch.tensor([[1 / (1 + a), a / (1 + a)], [0.5, 0.5]], dtype=F64)
    torch.testing.assert_close(walk.probs[0], want, rtol=1e-12, atol=0)  # (T, T)
    torch.testing.assert_close(walk.out, want, rtol=1e-12, atol=0)  # (T, Dv)
    assert walk.scale == 1 / math.sqrt(2)


def test_seed004_one_head_closed_form():
    """Seed 004, no scaling: scores [[2, 4, 4], ...]; x1's output is (v1 + e^2 (v2 + v3)) /
    (1 + 2 e^2) = 1.93662, 6.68311, 1.59507 as SEEDS.md prints it."""
    walk = single_head(example_problem("seed004"))
    assert walk.scores[0].tolist() == [[2, 4, 4], [4, 16, 12], [4, 12, 10]]
    v = torch.tensor([[1, 2, 3], [2, 8, 0], [2, 6, 3]], dtype=F64)  # x W_V
    e2 = math.e**2
    torch.testing.assert_close(walk.out[0], (v[0] + e2 * (v[1] + v[2])) / (1 + 2 * e2))
    torch.testing.assert_close(
        walk.out[0], torch.tensor([1.93662, 6.68311, 1.59507], dtype=F64), rtol=0, atol=5e-6
    )


def test_seed000_two_heads_closed_form():
    """head_dim = 1: head 1 scores [[1, 0], [1, 0]], head 2 [[0, 2], [0, 1]]; W^O = I."""
    walk = multi_head(example_problem("seed000"), 2)
    assert walk.scores.tolist() == [[[1, 0], [1, 0]], [[0, 2], [0, 1]]]  # (H, T, T)
    e = math.e
    want = torch.tensor([[e / (1 + e), e**2 / (1 + e**2)], [e / (1 + e), e / (1 + e)]], dtype=F64)
    torch.testing.assert_close(walk.out, want, rtol=1e-12, atol=0)  # (T, O)


def test_the_old_cli_names_are_the_librarys_objects():
    cli = importlib.import_module("qkv.cli.explain")
    lib = importlib.import_module("qkv.walkthrough")
    for name in set(cli.__all__) - CLI_ONLY:
        assert getattr(cli, name) is getattr(lib, name), name
        assert name in lib.__all__, name
    assert set(lib.__all__) == set(cli.__all__) - CLI_ONLY


def test_the_cli_keeps_parsing_and_printing_only():
    cli = importlib.import_module("qkv.cli.explain")
    own = {
        n
        for n, v in vars(cli).items()
        if callable(v) and getattr(v, "__module__", None) == cli.__name__
    }
    assert own == CLI_ONLY | {
        "_Printer",
        "_beside",
        "_join",
        "_print_intro",
        "_print_inputs",
        "_print_qkv",
        "_print_single",
        "_print_tutorial",
        "_print_multi",
        "_print_heads",
        "_cols",
        "_plot",
    }


def test_a_problem_pickled_by_its_old_path_loads():
    """A pickle naming ``qkv.cli.explain.Problem`` (before the move) finds it there still."""
    problem = example_problem("seed000")
    data = pickle.dumps(problem, protocol=0)  # protocol 0 names classes as text lines
    old = data.replace(b"cqkv.walkthrough\nProblem\n", b"cqkv.cli.explain\nProblem\n")
    assert old != data
    again = pickle.loads(old)
    assert type(again) is Problem
    torch.testing.assert_close(single_head(again).out, single_head(problem).out)
