"""``areal-fn`` under random command lines (#30): no traceback, no hang past 10 s, no
exit 0 with a flag that changed nothing.

Each example draws a command, its positionals from a pool of good and bad ones, and up
to four flags, each with a value from a pool by its kind (ints: negative, zero, small,
huge; choices: each one and a bogus one; paths: a new one, an occupied one, one that
cannot be written). The flags are read from the parser itself, so a new flag without a
pool of values fails :func:`test_every_flag_has_values_to_draw`.

The run must end within 10 s (a timer interrupts it) with exit 0, or exit 2 and one
``areal-fn: error:`` line (argparse's own refusals included); any other exception is a
traceback. After exit 0 each flag given is taken out in turn and the command run again:
the same output (stdout, the error line and every file written), while the flag's value
is not what the command does without it, and the same output for each other good value
of the flag (one its own check takes), means the flag was ignored.
``--overwrite`` and ``--trust-pickle`` are the exceptions: they permit something (an
existing DST, unpickling) and change nothing where it is not needed.
"""

import argparse
import hashlib
import json
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_fn.cli import build_parser, main
from areal_fn.model.demo import DEMO_CONFIG
from areal_fn.model.spec import model_from_hf_config
from areal_fn.runtime.commands.plan_flags import _ALLOCATION_ONLY, _SUGGEST_ONLY, DEFAULTS
from areal_fn.runtime.hf.io import write_hf_checkpoint
from tests.cli_terms import cli_term_problems

#: Seconds a command may run.
LIMIT_S = 10.0
#: The error line (argparse's own names the command: ``areal-fn convert: error:``).
ERROR = re.compile(r"areal-fn(?: [\w-]+)*: error: ")
#: Flags that permit something and rightly change nothing where it is not needed.
PERMITS = {"overwrite", "trust_pickle"}

#: Pools of values: (good ones, bad ones). An example draws from the good ones only,
#: or from both, so that combinations that succeed (where a flag can be ignored) come up
#: as often as refusals.
INTS = (["1", "2", "3", "8"], ["-1", "0", "1000000000000000000000"])
#: Values of the flags that take a string, by dest.
STRINGS: dict[str, tuple[list[str], list[str]]] = {
    "png": (["{new}"], ["{occupied}", "{file}", "/sys/areal_png"]),
    "workdir": (["{new}"], ["{occupied}", "{file}", "/sys/areal_wd"]),
    "device_memory": (["80GB", "80GiB", "1TB"], ["80", "0GB", "-5GB", "80G", "nanGB"]),
    "memory_margin": (["0", "0.5", "0.2"], ["-0.1", "1", "nan", "inf", "x"]),
    "grad_dtype": (["fp32", "bf16", "fp16"], ["fp8", "none"]),
    "master_dtype": (["fp32", "bf16", "fp16", "none"], ["fp8"]),
    "adam_dtype": (["fp32", "bf16", "fp16"], ["none"]),
    "ep_dispatch": (["alltoall", "deepep"], ["flex"]),
    "component": (["actor", "megatron", "megatron[actor]"], ["sglang", "fsdp", "x"]),
    "model": (["demo", "Qwen3-8B"], ["{hf}", "nope", "{file}"]),
    "format": (["rank-files", "torch_dist"], ["safetensors"]),
    "fp8": (["128x128", "16x16"], ["0x128", "128", "x16"]),
    "merge": (["{hf}"], ["nope", "{file}"]),
}
#: Positionals of each command: pools per positional ("" leaves an optional one out).
POSITIONALS: dict[str, list[tuple[list[str], list[str]]]] = {
    "plan": [
        (["demo", "Qwen3-8B", "Qwen3-30B-A3B", "{hf}"], ["nope", "{file}"]),
        (
            [
                "",
                "megatron:t2",
                "megatron:d2p2t2e2",
                "megatron[actor]:(attn:d2t2|ffn:t2e2)",
                "fsdp:d4",
                "fsdp:d2t2",
                "sglang:t2+megatron[actor]:t2",
                "vllm:d2t2",
            ],
            ["megatron:t3", "fsdp:d1048576", "megatron"],
        ),
    ],
    "convert": [
        (["{hf}", "{local}", "{td}"], ["nope", "{file}"]),
        (["", "megatron:t2", "megatron:d2p2", "fsdp:d2", "sglang:t2"], ["megatron:d2e2", "x:1"]),
        (["{new}"], ["{occupied}", "/sys/areal_out"]),
    ],
    "checkpoint inspect": [(["{ckpt}"], ["nope", "{hf}"])],
    "checkpoint export-hf": [(["{ckpt}"], ["nope", "{hf}"]), (["{new}"], ["{occupied}"])],
    "models": [],
    "demo": [],
}


def _commands() -> dict[str, argparse.ArgumentParser]:
    """``plan``, ``checkpoint inspect``, ...: each command's own parser."""
    out: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, prefix: str) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs and prefix:
            out[prefix] = parser
        for action in subs:
            for name, sub in action.choices.items():
                walk(sub, f"{prefix} {name}".strip())

    walk(build_parser(), "")
    return out


COMMANDS = _commands()


def _flags(command: str) -> list[argparse.Action]:
    return [a for a in COMMANDS[command]._actions if a.option_strings and a.dest not in ("help",)]


def _values(action: argparse.Action, *, good: bool = False) -> list[str | None]:
    """The pool of ``action``'s values (None: a flag without a value); ``good``: only
    those that pass its own check."""
    if action.nargs == 0:
        return [None]
    if action.choices is not None:
        return [*map(str, action.choices), *([] if good else ["bogus"])]
    fine, bad = INTS if action.type is int else STRINGS[action.dest]
    return list(fine) if good else [*fine, *bad]


def test_every_flag_has_values_to_draw() -> None:
    assert set(COMMANDS) == set(POSITIONALS)
    for command in COMMANDS:
        for action in _flags(command):
            assert _values(action), f"{command} {action.option_strings[0]}: no values"


#: Good command lines of each form of plan and convert, and the flags each form does
#: not take (plan_flags' own tables; convert's directions), so that good examples succeed.
FORMS: dict[str, list[tuple[list[str], set[str]]]] = {
    "plan": [
        (["{model}", "{alloc}"], {"suggest", *_SUGGEST_ONLY}),
        (
            ["{model}", "--suggest", "8", "--device-memory", "1TB"],
            {"suggest", "device_memory", *_ALLOCATION_ONLY},
        ),
    ],
    "convert": [
        (["{hf}", "{alloc}", "{new}"], {"to_hf", "model", "trust_pickle", "drop_optimizer"}),
        (["{local}", "{new}", "--to-hf"], {"to_hf", "rank", "layer_spec", "mtp", "drop_mtp"}),
        (
            ["{td}", "{new}", "--to-hf", "--trust-pickle"],
            {"to_hf", "trust_pickle", "rank", "layer_spec", "mtp", "drop_mtp", "component"},
        ),
    ],
}


@st.composite
def command_lines(draw: st.DrawFn, command: str) -> list[str]:
    """``command``'s words, positionals and flags (templates: ``{new}`` etc.): good ones
    (a form of the command, good values) or any."""
    words = command.split()
    flags = _flags(command)
    pools = POSITIONALS[command]
    if draw(st.booleans()) and command in FORMS:
        form, skip = draw(st.sampled_from(FORMS[command]))
        models = [v for v in pools[0][0] if v != "{hf}"] if command == "plan" else [""]
        allocs = [v for v in pools[1][0] if v]
        fill = {"model": draw(st.sampled_from(models)), "alloc": draw(st.sampled_from(allocs))}
        words += [w.format(**fill) if w in ("{model}", "{alloc}") else w for w in form]
        flags = [a for a in flags if a.dest not in skip]
        good = True
    else:
        good = False
        for fine, bad in pools:
            if value := draw(st.sampled_from(fine + bad)):
                words.append(value)
    chosen = draw(st.lists(st.sampled_from(flags), max_size=4, unique_by=id)) if flags else []
    for action in chosen:
        value = draw(st.sampled_from(_values(action, good=good)))
        words += [draw(st.sampled_from(action.option_strings))]
        words += [] if value is None else [value]
    return words


class Hang(Exception):
    """The command ran past :data:`LIMIT_S`."""


@contextmanager
def _time_limit() -> Iterator[None]:
    def on_alarm(signum: int, frame: object) -> None:
        raise Hang

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, LIMIT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _tree(root: Path) -> list[tuple[str, str]]:
    """Every file under ``root``: (relative path, BLAKE2 of its bytes)."""
    return sorted(
        (str(p.relative_to(root)), hashlib.blake2b(p.read_bytes()).hexdigest())
        for p in root.rglob("*")
        if p.is_file()
    )


class Runner:
    """Runs command lines in fresh directories and says what each did."""

    def __init__(self, inputs: dict[str, Path], base: Path, capsys: pytest.CaptureFixture[str]):
        self.inputs, self.base, self.capsys, self.n = inputs, base, capsys, 0

    def words(self, template: list[str], run: Path) -> list[str]:
        """``template`` with its placeholders made: inputs shared, outputs under ``run``."""
        (run / "occupied").mkdir(parents=True)
        (run / "occupied" / "notes.txt").write_text("mine\n")
        names = {k: str(v) for k, v in self.inputs.items()}
        names |= {"new": str(run / "new"), "occupied": str(run / "occupied")}
        return [w.format(**names) for w in template]

    def run(self, template: list[str]) -> tuple[object, ...]:
        """(exit status, stdout, last stderr line, files written) of ``template``."""
        self.n += 1
        run = self.base / f"run{self.n}"
        argv = self.words(template, run)
        start = time.monotonic()
        try:
            with _time_limit():
                rc = main(argv)
        except SystemExit as e:  # argparse refuses before the command runs
            rc = e.code
        except Hang:
            pytest.fail(f"areal-fn {' '.join(argv)} ran past {LIMIT_S} s")
        elapsed = time.monotonic() - start
        out, err = self.capsys.readouterr()
        assert rc in (0, 2) and "Traceback" not in err, f"areal-fn {' '.join(argv)}: {rc}\n{err}"
        error = [ln for ln in err.splitlines() if ERROR.match(ln)]
        if rc == 2:
            assert error, f"{argv}: {err}"
            assert not cli_term_problems(error[0], argv), (argv, error[0])
        assert elapsed < LIMIT_S, f"{argv}: {elapsed:.1f} s"
        shown = out.replace(str(run), "RUN"), err[err.find("areal-fn") :].replace(str(run), "RUN")
        return (rc, *shown, _tree(run))


def _without(template: list[str], i: int, action: argparse.Action) -> list[str]:
    return template[:i] + template[i + 1 + (action.nargs != 0) :]


def _effective(command: str, template: list[str]) -> dict[str, object]:
    """The parsed flags, with the values ``plan`` uses for those it leaves ``None``."""
    args = vars(build_parser().parse_args(template))
    if command == "plan":
        args |= {d: v for d, (_, v) in DEFAULTS.items() if args.get(d) is None}
    return args


def _other_values(template: list[str], i: int, action: argparse.Action) -> list[list[str]]:
    """``template`` with flag ``i`` given each other value of its pool."""
    if action.nargs == 0:
        return []
    given = template[i + 1]
    return [
        [*template[: i + 1], str(v), *template[i + 2 :]]
        for v in _values(action, good=True)
        if v != given
    ]


def check_no_flag_ignored(runner: Runner, command: str, template: list[str]) -> None:
    """Run ``template`` and, after exit 0, without each flag: the same output then, with
    the flag's value not the one used without it, and the same with each other good value
    of the flag's pool, means the command ignored the flag."""
    first = runner.run(template)
    if first[0] != 0:
        return
    options = {o: a for a in _flags(command) for o in a.option_strings}
    for i, word in enumerate(template):
        action = options.get(word)
        if action is None or action.dest in PERMITS:
            continue
        fewer = _without(template, i, action)
        if _effective(command, fewer) == _effective(command, template):
            continue  # the value given is the one used without it
        if runner.run(fewer) != first:
            continue
        others = [runner.run(t) for t in _other_values(template, i, action)]
        assert any(o != first for o in others), (
            f"areal-fn {' '.join(template)}: exit 0, and the same without {word} and with "
            "each other value: the flag was ignored"
        )


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An HF checkpoint of the demo model, its megatron:t2 rank files and torch_dist
    checkpoint, a canonical checkpoint and a plain file."""
    from areal_fn import ParallelDims, fsdp2_layout, to_megatron
    from areal_fn.runtime.checkpoint.api import RankState, save_checkpoint

    root = tmp_path_factory.mktemp("fuzz_inputs")
    model = model_from_hf_config(DEMO_CONFIG)
    gen = torch.Generator().manual_seed(0)
    canon = {t.name: torch.randn(t.shape, generator=gen) for t in model.tensors}
    hf = write_hf_checkpoint(root / "hf", canon, model=model)
    assert main(["convert", str(hf), "megatron:t2", str(root / "local")]) == 0
    td = ["convert", str(hf), "megatron:t2", str(root / "td"), "--format", "torch_dist"]
    assert main(td) == 0
    layout = fsdp2_layout(model, ParallelDims(dp=2))
    states = {r: RankState(params=to_megatron(canon, layout, r)) for r in range(2)}
    save_checkpoint(
        root / "ckpt", layout=layout, states=states, model=model, allocation="fsdp:d2", step=1
    )
    (root / "file").write_text("not a directory\n")
    names = ("hf", "local", "td", "ckpt", "file")
    return {name: root / name for name in names}


#: Examples per command (the ci profile's bound; plan has the most flags).
EXAMPLES = {"plan": 120, "convert": 80, "checkpoint inspect": 30, "checkpoint export-hf": 20}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_random_command_lines(
    command: str,
    inputs: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import areal_fn.runtime.demo.driver as driver

    def fake_demo(*, steps: int, workdir: str | None) -> int:
        """The demo's own flag checks, then what it was asked (not 4 processes)."""
        driver.check_demo_flags(steps=steps, workdir=workdir)
        print(json.dumps({"steps": steps, "workdir": workdir}))
        return 0

    monkeypatch.setattr(driver, "run_demo", fake_demo)

    @settings(
        max_examples=EXAMPLES.get(command, 10),
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(template=command_lines(command))
    def check(template: list[str]) -> None:
        runner = Runner(inputs, tmp_path_factory.mktemp("fuzz"), capsys)
        check_no_flag_ignored(runner, command, template)

    check()


def test_the_ignored_flag_check_catches_an_ignored_flag(
    inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    """The check itself: a plan that drops --tensors is caught."""
    import areal_fn.runtime.commands.plan as plan

    original = plan.cmd_plan

    def dropping(console, model, args, **kw):  # type: ignore[no-untyped-def]
        args.tensors = 0
        return original(console, model, args, **kw)

    monkeypatch.setattr(plan, "cmd_plan", dropping)
    runner = Runner(inputs, tmp_path, capsys)
    with pytest.raises(AssertionError, match=re.escape("same without --tensors")):
        check_no_flag_ignored(runner, "plan", ["plan", "demo", "megatron:t2", "--tensors", "3"])
