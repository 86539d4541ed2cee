"""Wheels for a GPU machine without a package registry: what to install, and from where.

The GPU machine has torch, transformers, attrs, jaxtyping, hypothesis, safetensors and
rich, but no registry; megatron-core, beartype and this package travel as wheel files.
:func:`install_plan` (pure) decides which wheels of a folder install what is missing
(the wheel's tags must suit this interpreter) and the ``pip install --no-index`` line;
it refuses, naming the package and the remedy, when a needed wheel is absent.
:func:`prepare_commands` (pure) gives the ``pip`` lines that build and download those
wheels on a machine with a registry, for the GPU machine's Python 3.12 on x86_64.
"""

import importlib.metadata
import importlib.util
import re
import sys
from collections.abc import Mapping, Sequence

import attrs

from areal_fn.typecheck import beartype
from bench.gpu.compare import GpuCheckError

__all__ = [
    "REQUIRED",
    "TARGET_PLATFORMS",
    "TARGET_PYTHON",
    "InstallPlan",
    "Requirement",
    "WheelName",
    "importable",
    "install_plan",
    "installed_versions",
    "parse_wheel_name",
    "prepare_commands",
    "supported_tags",
]

#: The GPU machine's interpreter and platform (``pip download`` targets them).
TARGET_PYTHON = "3.12"
TARGET_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64")

Tag = tuple[str, str, str]


@attrs.frozen(kw_only=True)
class Requirement:
    """A distribution the check needs and the module that shows it is installed."""

    dist: str
    module: str


#: What may be missing on the GPU machine, in install order.
REQUIRED: tuple[Requirement, ...] = (
    Requirement(dist="beartype", module="beartype"),
    Requirement(dist="megatron-core", module="megatron.core"),
    Requirement(dist="areal-fn", module="areal_fn"),
)


def normalize(name: str) -> str:
    """PEP 503's normal form of a distribution name (``Megatron_Core`` -> ``megatron-core``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@attrs.frozen(kw_only=True)
class WheelName:
    """A wheel file's name, parsed (PEP 427): distribution, version, the tags it suits."""

    filename: str
    dist: str
    version: str
    tags: frozenset[Tag]


_WHEEL = re.compile(
    r"^(?P<dist>[A-Za-z0-9](?:[A-Za-z0-9._]*[A-Za-z0-9])?)-(?P<version>[^-]+)"
    r"(?:-(?P<build>\d[^-]*))?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$"
)


@beartype
def parse_wheel_name(filename: str) -> WheelName:
    """Parse ``dist-version[-build]-python-abi-platform.whl``; tags expand ``.``-sets."""
    m = _WHEEL.match(filename)
    if m is None:
        raise GpuCheckError(
            f"{filename!r} is not a wheel file name (dist-version[-build]-python-abi-"
            "platform.whl, PEP 427); remove it from the wheel folder or rename it"
        )
    tags = frozenset(
        (py, abi, plat)
        for py in m["py"].split(".")
        for abi in m["abi"].split(".")
        for plat in m["plat"].split(".")
    )
    return WheelName(filename=filename, dist=normalize(m["dist"]), version=m["version"], tags=tags)


@attrs.frozen(kw_only=True)
class InstallPlan:
    """Which wheel installs which missing distribution, and the pip command (or none)."""

    missing: tuple[str, ...]
    installs: tuple[tuple[str, str], ...]  # (dist, wheel file name), in REQUIRED order
    command: tuple[str, ...] | None

    def __str__(self) -> str:
        if not self.missing:
            return "install plan: nothing missing"
        picks = ", ".join(f"{d} <- {f}" for d, f in self.installs)
        return f"install plan: {picks}\n  {' '.join(self.command or ())}"


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version))


@beartype
def install_plan(
    missing: Sequence[str],
    wheel_files: Sequence[str],
    *,
    supported: Sequence[Tag],
    wheel_dir: str | None,
    python: str,
) -> InstallPlan:
    """The wheels of ``wheel_files`` (names in ``wheel_dir``) that install ``missing``.

    Per missing distribution the newest wheel whose tags include one of ``supported``
    (this interpreter's tags) is chosen; ``.whl`` names that do not parse are refused,
    other files ignored. Raises ``GpuCheckError`` naming every distribution without a
    suitable wheel and the remedy. The command is
    ``python -m pip install --no-index --find-links DIR --no-deps WHEEL...``.
    """
    want = [normalize(d) for d in missing]
    if not want:
        return InstallPlan(missing=(), installs=(), command=None)
    if wheel_dir is None:
        raise GpuCheckError(
            f"{', '.join(want)} not importable and no --wheels DIR given; build the wheels "
            "with `python -m bench.gpu prepare-wheels DIR` where a registry is reachable, "
            "then pass --wheels DIR"
        )
    ok = set(supported)
    wheels = [parse_wheel_name(f) for f in sorted(wheel_files) if f.endswith(".whl")]
    installs, absent = [], []
    for dist in want:
        mine = [w for w in wheels if w.dist == dist]
        fits = [w for w in mine if w.tags & ok]
        if not fits:
            seen = "; ".join(f"{w.filename} (tags do not suit this Python)" for w in mine)
            absent.append(f"{dist} ({seen or 'no wheel of it'})")
            continue
        best = max(fits, key=lambda w: (_version_key(w.version), w.filename))
        installs.append((dist, best.filename))
    if absent:
        raise GpuCheckError(
            f"--wheels {wheel_dir} has no installable wheel for: {', '.join(absent)}; run "
            f"`python -m bench.gpu prepare-wheels {wheel_dir}` where a registry is reachable "
            f"(it targets Python {TARGET_PYTHON} on {TARGET_PLATFORMS[0]}) and copy the folder here"
        )
    command = (
        python,
        "-m",
        "pip",
        "install",
        "--no-index",
        "--find-links",
        wheel_dir,
        "--no-deps",
        *(f"{wheel_dir.rstrip('/')}/{f}" for _, f in installs),
    )
    return InstallPlan(missing=tuple(want), installs=tuple(installs), command=command)


@beartype
def prepare_commands(
    dest: str, *, versions: Mapping[str, str], python: str, source: str = "."
) -> tuple[tuple[str, ...], ...]:
    """The pip lines that fill ``dest`` with the GPU machine's wheels.

    ``pip wheel SOURCE --no-deps`` (this package), then ``pip download`` of
    megatron-core and beartype at ``versions`` (the versions installed here) as binary
    wheels for Python ``TARGET_PYTHON`` on ``TARGET_PLATFORMS``, without dependencies.
    """
    need = ("megatron-core", "beartype")
    lacking = [d for d in need if not versions.get(d)]
    if lacking:
        raise GpuCheckError(
            f"no installed version of {lacking} to pin; install them here first "
            "(pip install -e '.[dev]') so that the GPU machine gets the tested versions"
        )
    build = (python, "-m", "pip", "wheel", source, "--no-deps", "-w", dest)
    platforms = [x for p in TARGET_PLATFORMS for x in ("--platform", p)]
    download = (
        python,
        "-m",
        "pip",
        "download",
        *(f"{d}=={versions[d]}" for d in need),
        "--python-version",
        TARGET_PYTHON,
        *platforms,
        "--implementation",
        "cp",
        "--abi",
        "cp" + TARGET_PYTHON.replace(".", ""),
        "--only-binary=:all:",
        "--no-deps",
        "-d",
        dest,
    )
    return build, download


# -- the impure side: what this interpreter has --------------------------------------------
def importable(module: str) -> bool:
    """Whether ``import module`` would find it (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def installed_versions(dists: Sequence[str] = ("megatron-core", "beartype")) -> dict[str, str]:
    """Installed versions of ``dists`` (absent ones left out)."""
    out = {}
    for d in dists:
        try:
            out[d] = importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def supported_tags() -> list[Tag]:
    """This interpreter's wheel tags, most specific first (``packaging.tags``)."""
    from packaging import tags

    return [(t.interpreter, t.abi, t.platform) for t in tags.sys_tags()]


def default_python() -> str:
    return sys.executable
