"""`parse_allocation`: allocation strings -> :class:`~areal_fn.strategy.allocation.Allocation`.

A hand-written recursive-descent parser for the grammar in ``docs/allocation.md``.
Every invalid string raises :class:`~areal_fn.errors.ParseError`; its message says
what was expected, then shows the input with a caret under the offending character
(:mod:`areal_fn.strategy.parse_errors` draws it).
"""

import re
import string
from typing import NoReturn

from areal_fn.errors import ParseError, SpecError
from areal_fn.strategy.allocation import (
    MAX_DEGREE,
    MAX_WORLD_SIZE,
    Allocation,
    Backend,
    Component,
    ParallelDims,
    choices,
)
from areal_fn.strategy.parse_errors import (
    _BACKEND_LIST,
    _DIM_NAMES,
    _SECTION_DIMS,
    _WS,
    _char,
    _not_a_backend,
    _pointer,
    _refusal,
    _short,
    _takes,
    _where,
)
from areal_fn.typecheck import beartype

__all__ = ["parse_allocation"]

_DIGITS = "0123456789"
_LETTERS = frozenset(string.ascii_letters)
_NAME_START = frozenset(string.ascii_letters + "_")
_WORD = frozenset(string.ascii_letters + string.digits + "_")
_MAX_DIGITS = len(str(MAX_DEGREE))
_BACKENDS = {b.value: b for b in Backend}
#: Anything but printable ASCII and the whitespace in _WS.
_NOT_ALLOWED = re.compile(r"[^\x20-\x7e\t\r\n]")

#: letter -> (value, position of the letter); key "x" holds the HSDP replicas of "d".
Dims = dict[str, tuple[int, int]]


@beartype
def parse_allocation(text: str) -> Allocation:
    """Parse an allocation string such as ``sglang:d4t2+megatron:d2p2t2``.

    ``+`` joins disaggregated groups (disjoint consecutive rank ranges), ``|``
    colocates components (shared ranks; binds tighter than ``+``). A component is
    ``backend[name]:dims`` with the name optional, or the megatron hybrid form
    ``megatron[name]:(attn:dims|ffn:dims)`` (the parentheses may be left out, as AReaL
    allows). fsdp writes HSDP as ``d<replicas>x<shards>`` (``fsdp:d2x4``). Whitespace
    is allowed between any two tokens (``fsdp : d4``), never inside a word or a number.

    Raises :class:`~areal_fn.errors.ParseError` for every invalid string.
    """
    return _Parser(text).allocation()


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.end = len(text.rstrip(_WS))
        self.pos = len(text) - len(text.lstrip(_WS)) if self.end else 0
        self.names: dict[str, int] = {}
        self.unnamed: list[tuple[int, Backend]] = []
        self.count = 0

    # -- helpers ---------------------------------------------------------------
    def fail(self, pos: int, what: str) -> NoReturn:
        raise ParseError(f"invalid allocation: {what}\n{_pointer(self.text, pos)}")

    def got(self, pos: int) -> str:
        return "end of input" if pos >= self.end else _char(self.text[pos])

    def expected(self, what: str, pos: int | None = None) -> NoReturn:
        at = self.pos if pos is None else pos
        self.fail(at, f"expected {what}, got {self.got(at)}")

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < self.end else ""

    def skip_ws(self) -> None:
        while self.pos < self.end and self.text[self.pos] in _WS:
            self.pos += 1

    def ahead(self) -> int:
        """The position of the next character that is not whitespace."""
        at = self.pos
        while at < self.end and self.text[at] in _WS:
            at += 1
        return at

    def word(self) -> str:
        start = self.pos
        while self.pos < self.end and self.text[self.pos] in _WORD:
            self.pos += 1
        return self.text[start : self.pos]

    def word_at(self, at: int) -> str:
        stop = at
        while stop < self.end and self.text[stop] in _WORD:
            stop += 1
        return self.text[at:stop]

    # -- grammar ---------------------------------------------------------------
    def allocation(self) -> Allocation:
        bad = _NOT_ALLOWED.search(self.text)
        if bad is not None:
            i, ch = bad.start(), bad.group()
            if ch.isdigit():
                self.fail(
                    i, f"non-ASCII digit {_char(ch)}; write numbers with the ASCII digits 0-9"
                )
            self.fail(
                i,
                f"character {_char(ch)} is not allowed; allocation strings are printable "
                f"ASCII: backends, names, dims, ':', '[', ']', '(', ')', '+', '|'",
            )
        if self.pos >= self.end:
            self.fail(
                self.pos,
                "empty allocation; expected at least one component such as 'fsdp:d8' or "
                "'sglang:d4t2+megatron:d2p2t2'",
            )
        groups: list[tuple[Component, ...]] = []
        total = 0
        while True:
            start = self.pos
            group = self.group()
            total += group[0].world_size
            if total > MAX_WORLD_SIZE:
                self.fail(
                    start,
                    f"the allocation needs {total} ranks up to here, more than the maximum "
                    f"{MAX_WORLD_SIZE} (2**20); use smaller degrees or fewer components",
                )
            groups.append(group)
            self.skip_ws()
            if self.pos >= self.end:
                break
            if self.peek() == "+":
                self.pos += 1
                self.skip_ws()
                if self.pos >= self.end:
                    self.expected("a component after '+'")
                continue
            if self.peek() == ")":
                self.fail(self.pos, "unbalanced parentheses: ')' has no matching '('")
            if self.peek() == "." and self.text[self.pos - 1] in _DIGITS:
                self.fail(self.pos, "unexpected '.': degrees are whole numbers such as 'd4'")
            self.expected("'+', '|' or end of input after a component")
        if self.count >= 3 and self.unnamed:
            pos, backend = self.unnamed[0]
            self.fail(
                pos,
                f"with {self.count} components every component needs a name, and this one "
                f"has none; name it, e.g. "
                f"'{backend.value}[{'rollout' if backend.is_inference else 'actor'}]:...'",
            )
        try:
            return Allocation(groups=tuple(groups))
        except SpecError as exc:  # the checks above should have caught it first
            self.fail(0, str(exc))

    def group(self) -> tuple[Component, ...]:
        first_start = self.pos
        comps = [self.component()]
        while True:
            save = self.pos
            self.skip_ws()
            if self.peek() != "|":
                self.pos = save
                return tuple(comps)
            self.pos += 1
            self.skip_ws()
            if self.pos >= self.end:
                self.expected("a component after '|'")
            start = self.pos
            comp = self.component()
            if comp.world_size != comps[0].world_size:
                first = self.text[first_start:save].rstrip(_WS)
                self.fail(
                    start,
                    f"colocated components share one rank range and need equal world sizes: "
                    f"{_short(first)!r} has {comps[0].world_size}, this one has "
                    f"{comp.world_size}; change the degrees or disaggregate with '+'",
                )
            comps.append(comp)

    def component(self) -> Component:
        start = self.pos
        backend = self.backend(self.word(), start)
        self.skip_ws()
        name = None
        if self.peek() == "[":
            name = self.name()
            self.skip_ws()
        if self.peek() != ":":
            if self.peek() == "(" and self.text.startswith("(attn", self.pos):
                self.fail(
                    self.pos,
                    f"expected ':' before the hybrid form: write '{backend.value}:(attn:...|ffn:...)'",
                )
            if self.peek() == "(":
                self.expected(
                    f"':' or '[' after '{backend.value}' (names go in square brackets, e.g. '{backend.value}[actor]:d4')"
                )
            self.expected(f"':' after the backend '{backend.value}' (e.g. '{backend.value}:d4')")
        self.pos += 1
        self.skip_ws()
        if self.peek() == "(" or self.word_at(self.pos) in ("attn", "ffn"):
            dims = self.hybrid(backend, start)
        else:
            dims = self.plain(backend, start)
        self.count += 1
        if name is None:
            self.unnamed.append((start, backend))
        try:
            return Component(name=name, backend=backend, dims=dims)
        except SpecError as exc:  # the checks above should have caught it first
            self.fail(start, str(exc))

    def backend(self, word: str, start: int) -> Backend:
        if word in _BACKENDS:
            return _BACKENDS[word]
        at = self.ahead()
        ch = self.text[at] if at < self.end else ""
        rest = self.word_at(at) if at > self.pos else ""
        if word and rest and word + rest in _BACKENDS:
            self.fail(
                self.pos,
                f"whitespace inside the backend {word + ' ' + rest!r}; write {word + rest!r}",
            )
        hybrid = "missing backend before the hybrid form; write 'megatron:(attn:...|ffn:...)'"
        if not word:
            if ch == "[":
                self.fail(
                    start,
                    "missing backend before '[': a component starts with its backend, e.g. 'fsdp[actor]:d4'",
                )
            if self.text.startswith("(attn", start):
                self.fail(start, hybrid)
            if ch == "(":
                self.fail(
                    start,
                    "unexpected '(': parentheses only enclose the megatron hybrid form 'megatron:(attn:...|ffn:...)'",
                )
            if ch == ")":
                self.fail(start, "unbalanced parentheses: ')' has no matching '('")
            self.expected(f"a component starting with a backend ({_BACKEND_LIST})")
        if word in ("attn", "ffn"):
            self.fail(start, hybrid)
        self.fail(start, _not_a_backend(word, ch))

    def name(self) -> str:
        open_pos = self.pos
        self.pos += 1
        self.skip_ws()
        name_pos = self.pos
        if self.peek() not in _NAME_START:
            self.expected("a name after '[' (a letter or '_', then letters, digits or '_')")
        name = self.word()
        self.skip_ws()
        if self.peek() in _WORD:
            self.fail(
                self.pos,
                f"whitespace inside the name opened at position {open_pos}; a name is one "
                f"identifier such as 'actor' or 'actor_2'",
            )
        if self.peek() != "]":
            self.expected(f"']' to close the name opened at position {open_pos}")
        self.pos += 1
        if name in self.names:
            self.fail(
                name_pos,
                f"duplicate name {_short(name)!r} (first at position {self.names[name]}); "
                f"every name must be unique",
            )
        self.names[name] = name_pos
        return name

    def dims(self, backend: Backend, section: str) -> Dims:
        taken, unit_only = _SECTION_DIMS[(section, backend)]
        seen: Dims = {}
        while True:
            at = self.ahead()
            if at >= self.end or self.text[at] not in _LETTERS:
                break
            self.pos = letter_pos = at
            letter = self.text[letter_pos]
            if letter == "x":
                self.fail(
                    letter_pos,
                    "'x' goes right after d's number: fsdp writes HSDP as "
                    "d<replicas>x<shards>, e.g. 'fsdp:d2x4'",
                )
            if letter not in taken and letter not in unit_only:
                self.fail(letter_pos, _refusal(backend, section, letter))
            if letter in seen:
                self.fail(
                    letter_pos,
                    f"repeated dimension {letter!r} ({_DIM_NAMES[letter]}), first given at "
                    f"position {seen[letter][1]}; give each dimension at most once",
                )
            self.pos += 1
            self.skip_ws()
            value = self.number(letter)
            if letter in unit_only and value != 1:
                self.fail(
                    letter_pos,
                    f"{backend.value} does not support {letter} ({_DIM_NAMES[letter]}) > 1, got "
                    f"{letter}{value}; use megatron for {_DIM_NAMES[letter]}ism",
                )
            seen[letter] = (value, letter_pos)
            if letter == "d" and self.text[self.ahead() : self.ahead() + 1] == "x":
                self.replicas(seen, backend, section)
        if not seen:
            where = f"'{section}:'" if section != "plain" else f"'{backend.value}:'"
            self.expected(
                f"a dimension such as 'd4' after {where} ({_where(backend, section)} takes "
                f"{_takes(backend, section)})",
                self.ahead(),
            )
        return seen

    def replicas(self, seen: Dims, backend: Backend, section: str) -> None:
        """``d<replicas>x<shards>``: HSDP, fsdp only; ``seen["d"]`` becomes the product."""
        replicas, d_pos = seen["d"]
        self.pos = self.ahead()
        if section != "plain" or backend is not Backend.FSDP:
            self.fail(
                self.pos,
                f"'x' after d{replicas}: HSDP replicas x shards (d<replicas>x<shards>) are "
                f"for fsdp only; {_where(backend, section)} takes d as one number",
            )
        self.pos += 1
        self.skip_ws()
        shards = self.number("x")
        if replicas * shards > MAX_DEGREE:
            self.fail(
                d_pos,
                f"d{replicas}x{shards} is {replicas * shards} data-parallel ranks, more than "
                f"the maximum {MAX_DEGREE} (2**20); use smaller degrees",
            )
        seen["d"] = (replicas * shards, d_pos)
        seen["x"] = (replicas, d_pos)

    def number(self, letter: str) -> int:
        start = self.pos
        while self.pos < self.end and self.text[self.pos] in _DIGITS:
            self.pos += 1
        digits = self.text[start : self.pos]
        if not digits:
            self.expected(f"a number after {letter!r} (e.g. '{letter}2')")
        if digits[0] == "0":
            if digits.strip("0") == "":
                self.fail(
                    start,
                    f"{letter}{_short(digits)}: every degree must be >= 1, got 0; write "
                    f"{letter}1 or leave {letter} out (an omitted dimension is 1)",
                )
            self.fail(
                start,
                f"{letter}{_short(digits)} has a leading zero; write {letter}{_short(digits.lstrip('0'))}",
            )
        if len(digits) > _MAX_DIGITS or int(digits) > MAX_DEGREE:
            self.fail(
                start,
                f"{letter}{_short(digits)} is too large ({len(digits)} digits); every degree is "
                f"at most {MAX_DEGREE} (2**20)",
            )
        at = self.ahead()
        if at > self.pos and at < self.end and self.text[at] in _DIGITS:
            more = self.text[at:].split(maxsplit=1)[0]
            self.fail(
                self.pos,
                f"whitespace inside a number: {letter}{digits} {_short(more)}; write the number "
                f"without spaces ({letter}{digits}{_short(more)}) or give each number its letter",
            )
        return int(digits)

    def plain(self, backend: Backend, start: int) -> ParallelDims:
        seen = self.dims(backend, "plain")
        d, p, t, c, e, v, r = (seen.get(k, (1, -1))[0] for k in "dptcevx")
        self.check_world(start, d, p, t, c)
        self.check_vpp(seen, p)
        if (d * t * c) % e:
            self.fail(
                seen["e"][1],
                f"e{e} (expert parallel) must divide d*t*c = {d}*{t}*{c} = {d * t * c}, the "
                f"ranks of one pipeline stage that the experts are spread over; use e in "
                f"{choices(d * t * c)}",
            )
        return ParallelDims(dp=d, tp=t, pp=p, cp=c, ep=e, vpp=v, dp_replicate=r)

    def hybrid(self, backend: Backend, start: int) -> ParallelDims:
        open_pos = self.pos
        paren = self.peek() == "("
        if backend is not Backend.MEGATRON:
            self.fail(
                open_pos,
                f"the hybrid form '(attn:...|ffn:...)' is only for megatron, not "
                f"{backend.value}; write 'megatron:(attn:...|ffn:...)'",
            )
        if paren:
            self.pos += 1
            self.skip_ws()
        self.keyword("attn", "the attn section comes first: '(attn:...|ffn:...)'")
        attn = self.dims(backend, "attn")
        self.skip_ws()
        if self.peek() != "|":
            self.expected("'|' and the ffn section after the attn section (e.g. '|ffn:e2')")
        self.pos += 1
        self.skip_ws()
        ffn_pos = self.pos
        self.keyword("ffn", "the hybrid form has one attn and one ffn section")
        ffn = self.dims(backend, "ffn")
        if paren:
            self.close(open_pos)
        return self.hybrid_dims(start, attn, ffn, ffn_pos)

    def close(self, open_pos: int) -> None:
        self.skip_ws()
        if self.peek() != ")":
            if self.pos >= self.end:
                self.fail(
                    self.pos,
                    f"unbalanced parentheses: expected ')' to close the '(' at position "
                    f"{open_pos}, got end of input",
                )
            self.expected(f"')' to close the '(' at position {open_pos}")
        self.pos += 1

    def hybrid_dims(self, start: int, attn: Dims, ffn: Dims, ffn_pos: int) -> ParallelDims:
        d, p, t, c, v = (attn.get(k, (1, -1))[0] for k in "dptcv")
        world = self.check_world(start, d, p, t, c)
        self.check_vpp(attn, p)
        if "p" in ffn and ffn["p"][0] != p:
            self.fail(
                ffn["p"][1],
                f"ffn p{ffn['p'][0]} differs from attn p{p}; attention and expert layers "
                f"share one pipeline: write the same p in both sections or leave it out of ffn",
            )
        etp, ep = ffn.get("t", (1, -1))[0], ffn.get("e", (1, -1))[0]
        stage = d * t * c
        if "d" in ffn:
            edp = ffn["d"][0]
            ffn_world = edp * p * etp * ep
            if ffn_world != world:
                remedy = (
                    f"write ffn d{stage // (etp * ep)} or leave ffn d out to derive it"
                    if stage % (etp * ep) == 0
                    else f"choose ffn t*e in {choices(stage)}"
                )
                self.fail(
                    ffn_pos,
                    f"the ffn section covers d*p*t*e = {edp}*{p}*{etp}*{ep} = {ffn_world} ranks "
                    f"but the attn section covers d*p*t*c = {d}*{p}*{t}*{c} = {world}; both "
                    f"sections must cover the same ranks: {remedy}",
                )
        elif stage % (etp * ep):
            self.fail(
                ffn_pos,
                f"cannot derive ffn d: ffn t*e = {etp}*{ep} = {etp * ep} does not divide "
                f"attn d*t*c = {d}*{t}*{c} = {stage}, the ranks of one pipeline stage; choose "
                f"ffn t*e in {choices(stage)}",
            )
        return ParallelDims(dp=d, tp=t, pp=p, cp=c, ep=ep, etp=etp, vpp=v)

    def keyword(self, keyword: str, hint: str) -> None:
        start = self.pos
        word = self.word()
        if word != keyword:
            got = f"{_short(word)!r}" if word else self.got(start)
            self.fail(start, f"expected '{keyword}:' ({hint}), got {got}")
        self.skip_ws()
        if self.peek() != ":":
            self.expected(f"':' after '{keyword}'")
        self.pos += 1

    def check_world(self, start: int, d: int, p: int, t: int, c: int) -> int:
        world = d * p * t * c
        if world > MAX_WORLD_SIZE:
            self.fail(
                start,
                f"this component needs d*p*t*c = {d}*{p}*{t}*{c} = {world} ranks, more than "
                f"the maximum {MAX_WORLD_SIZE} (2**20); use smaller degrees",
            )
        return world

    def check_vpp(self, seen: Dims, p: int) -> None:
        if "v" in seen and seen["v"][0] > 1 and p == 1:
            self.fail(
                seen["v"][1],
                f"v{seen['v'][0]} (virtual pipeline stages) needs p >= 2, got p=1; add a "
                f"pipeline, e.g. 'p2v{seen['v'][0]}', or leave v out",
            )
