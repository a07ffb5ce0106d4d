"""The command line as a new user meets it: help, errors for bad arguments, a demo that talks."""

import io

import pytest

import jaxkv._ffi
from jaxkv import __main__ as entry
from jaxkv.demo import cli
from jaxkv.serving import loop

SMALL = ["--requests", "5", "--max-batch", "2", "--system-len", "4", "--max-prompt-len", "4",
         "--max-new-tokens", "6"]


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as e:
        entry.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "COMMAND" in out and "demo" in out


@pytest.mark.parametrize("argv", [[], ["bogus"]])
def test_a_missing_or_unknown_command_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        entry.main(argv)
    assert e.value.code == 2
    assert "python -m jaxkv: error:" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--seed", "-1"], "--seed must be in [0, 2**31), got -1"),
    (["--show", "-1"], "--show must be at least 0, got -1"),
    (["--requests", "0"], "--requests must be at least 1, got 0"),
    (["--model", "/nonexistent"], "--model /nonexistent: no config.json there"),
    (["--cache", "paged", "--page-size", "500"],
     "--page-size 500 is longer than the longest sequence (104 tokens"),
    (["--dtype", "int8"], "argument --dtype: invalid choice"),
    (["--mesh", "dp"], "--mesh: expected NAME=SIZE[,NAME=SIZE...], got 'dp'"),
    (["--mesh", "dp=3,tp=2"], "--mesh: dp=3 does not divide --max-batch 16"),
])
def test_bad_arguments_end_in_a_usage_error_not_a_traceback(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        entry.main(["demo", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "python -m jaxkv demo: error:" in err and message in err


def test_an_unreadable_checkpoint_is_an_error_not_a_traceback(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")  # no safetensors next to it
    assert cli.main(["--model", str(tmp_path), *SMALL]) == 2
    assert f"--model {tmp_path}" in capsys.readouterr().err


@pytest.mark.long
def test_demo_says_what_it_compiles_and_counts_requests(capsys):
    assert cli.main(SMALL) == 0
    out = capsys.readouterr().out
    compiling = out.index("compiling 4 step functions")
    assert compiling < out.index("5/5 requests")
    assert "5 requests admitted in" in out and "5 requests evicted in" in out
    assert "GPU autotuning" not in out  # that note is about GPUs


def test_progress_talks_off_a_terminal():
    """Off a terminal: a line at every tenth of the requests, and one at least every `every` s."""
    bar = cli.ProgressBar(total=100, label="jaxkv", every=3600)
    out = io.StringIO()
    stats = loop.Stats(generated=10)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.stdout", out)
        for _ in range(100):
            bar([object()], stats)
        lines = out.getvalue().splitlines()
        assert len(lines) == 10 and lines[-1].endswith("tok/s") and "100/100" in lines[-1]
        quiet = cli.ProgressBar(total=100, label="jaxkv", every=0)  # time-based lines
        quiet([], stats)
        quiet([], stats)
    assert len(out.getvalue().splitlines()) == 12


def test_an_extension_built_for_a_newer_jax_is_refused_on_import(monkeypatch):
    built = jaxkv._ffi._jaxkv.ffi_api_minor
    monkeypatch.setattr(jaxkv._ffi, "_runtime_ffi_api_minor", lambda: built - 1)
    with pytest.raises(ImportError, match=rf"built against XLA FFI API 0.{built}"):
        jaxkv._ffi._check_ffi_api()
    monkeypatch.setattr(jaxkv._ffi, "_runtime_ffi_api_minor", lambda: built + 1)
    jaxkv._ffi._check_ffi_api()  # an older extension loads in a newer jax
