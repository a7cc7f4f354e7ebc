"""`router --policy NAME=MODE` (repeatable) and `--paged-attn X` as its shorthand: parsed into one policy
per feature; two values for one feature that disagree exit 2 naming both."""

from __future__ import annotations

import pytest

from kvpact.router.cli import build_parser, config_from_args, main
from kvpact.shared.features import FeatureMode

AUTO, ON, OFF = FeatureMode.AUTO, FeatureMode.ON, FeatureMode.OFF


def config(*argv: str):  # type: ignore[no-untyped-def]
    return config_from_args(build_parser().parse_args(list(argv)))


def test_every_feature_defaults_to_auto():
    c = config()
    assert c.all_policies() == {
        "paged-attn": AUTO,
        "prefix-caching": AUTO,
        "cpu-kernels": AUTO,
        "quant-kernels": AUTO,
        "cuda-graphs": AUTO,
    }


def test_policy_is_repeatable_and_paged_attn_is_its_shorthand():
    c = config("--policy", "cuda-graphs=on", "--policy", "cpu-kernels=off", "--paged-attn", "on")
    assert c.all_policies() == {
        "paged-attn": ON,
        "prefix-caching": AUTO,
        "cpu-kernels": OFF,
        "quant-kernels": AUTO,
        "cuda-graphs": ON,
    }
    assert config("--policy", "paged-attn=off").policy is OFF
    assert config("--paged-attn", "on", "--policy", "paged-attn=on").policy is ON  # agreeing is fine


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--paged-attn", "on", "--policy", "paged-attn=off"],
         "--paged-attn on and --policy paged-attn=off disagree"),
        (["--policy", "cuda-graphs=on", "--policy", "cuda-graphs=off"],
         "--policy cuda-graphs=on and --policy cuda-graphs=off disagree"),
        (["--policy", "graphs=on"],
         "NAME one of paged-attn, prefix-caching, cpu-kernels, quant-kernels, cuda-graphs, got 'graphs=on'"),
        (["--policy", "cuda-graphs=yes"], "expected NAME=auto|on|off"),
    ],
)  # fmt: skip
def test_bad_or_disagreeing_policies_exit_2_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)  # the router's own entry point; it exits at the flags, before serving
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
