"""Every numeric flag of attn-train and attn-translate at 0, -1, a huge value, NaN and infinity:
accepted, or refused in one line that names the flag, never a traceback. The flags are read from
the commands' own parsers, so a flag added later is fuzzed too. Nothing is trained or translated:
this is the parse and the settings' check that run before any work."""
from __future__ import annotations

import argparse
import math

import pytest

from attn import translate as T
from attn.training.config import TrainConfigError, build_parser, config_from_argv

VALUES = ("0", "-1", "1e30", str(10**30), "nan", "inf", "-inf")


def numeric_flags(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(a.option_strings[-1] for a in parser._actions if a.option_strings and a.type in (int, float))


TRAIN_FLAGS = numeric_flags(build_parser())
TRANSLATE_FLAGS = numeric_flags(T.build_parser())


def test_the_flags_are_found():
    assert {"--steps", "--lr-factor", "--d-model", "--max-tokens", "--alpha"} <= set(TRAIN_FLAGS)
    assert set(TRANSLATE_FLAGS) == {"--beam", "--alpha", "--no-repeat-ngram", "--batch-size", "--max-length",
                                    "--speculate"}


def _parsed(parse, capsys):
    """(what ``parse`` returned, None), or (None, the error line argparse printed as it exited with status 2)."""
    try:
        return parse(), None
    except SystemExit as e:
        assert e.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err and "Traceback" not in "\n".join(err), err
        return None, err[-1]


def _check(flag: str, value: str, problem: str | None) -> None:
    """Refused naming the flag, or accepted; NaN is never accepted."""
    if problem is not None:
        assert "\n" not in problem and flag in problem, (flag, value, problem)
    else:
        assert not math.isnan(float(value)), f"{flag} {value} was accepted"


def _train_config(argv):
    """The settings attn-train checks before it reads any data, as attn-train makes them."""
    config = config_from_argv(argv).with_recipe()
    config.model_config(100)
    config.check_model_fits()
    return config


@pytest.mark.parametrize("flag", TRAIN_FLAGS)
def test_every_numeric_flag_of_attn_train(flag, tmp_path, capsys):
    for value in VALUES:
        try:
            _, problem = _parsed(lambda: _train_config(["--data", str(tmp_path), flag, value]), capsys)
        except TrainConfigError as e:
            problem = str(e)
        _check(flag, value, problem)


@pytest.mark.parametrize("flag", TRANSLATE_FLAGS)
def test_every_numeric_flag_of_attn_translate(flag, capsys):
    for value in VALUES:
        args, problem = _parsed(lambda: T.build_parser().parse_args(["--checkpoint", "c.npz", flag, value]), capsys)
        if args is not None:
            problem = T._check_args(args)
        _check(flag, value, problem)
