"""The built-in training corpus: Python-like modules written by a seeded generator, the same on every machine.

The trainer's default data (``data="synthetic"``). Python's own standard-library sources, the default
before, differ from one Python to the next, so a run's losses depended on the Python installed; this
text depends only on :data:`VERSION` and the seed. It needs no download and no file: the generator is
a few grammar rules over fixed word lists, driven by its own 64-bit generator (SplitMix64, integer
arithmetic only), so neither the platform nor ``random``'s implementation can change a byte.

What it holds: modules with docstrings, imports, constants, functions and classes; statements that
assign, accumulate, branch and loop over names in scope; comments and docstrings in simple English;
and ``assert`` lines whose sums and products are right, so that besides the syntax (indentation,
brackets, names defined before use) there is arithmetic to learn.

Changing the generator changes the corpus: bump :data:`VERSION` then (runs record it, and the
corpus hash, in ``summary.json``; ``tests/test_training_data.py`` pins the hash of this version).
"""

from __future__ import annotations

__all__ = ["VERSION", "DEFAULT_DOCUMENTS", "generate_documents"]

#: The generator's version: part of the corpus source name (``synthetic:v1``).
VERSION = 1
#: Documents (modules) of the default corpus: about 2 MB of text.
DEFAULT_DOCUMENTS = 800

_MASK = (1 << 64) - 1

_NOUNS = ("value", "count", "total", "index", "item", "buffer", "result", "weight", "scale", "offset", "size",
          "limit", "score", "record", "node", "edge", "path", "name", "token", "stream", "block", "layer", "batch",
          "step", "rate", "margin", "target", "source", "window", "key")  # fmt: skip
_ADJECTIVES = ("first", "last", "next", "largest", "smallest", "total", "mean", "current", "previous", "new", "old",
               "valid", "empty", "sorted", "final", "partial", "shared", "local")  # fmt: skip
_VERBS = ("return", "compute", "update", "check", "build", "collect", "merge", "split", "scale", "count", "find",
          "load", "store", "clip", "normalize", "sum")  # fmt: skip
_MODULES = ("math", "os", "sys", "json", "itertools", "functools", "collections", "re", "random", "time")
_CLASS_PARTS = (
    "Counter",
    "Buffer",
    "Table",
    "Graph",
    "Cache",
    "Queue",
    "Tracker",
    "Window",
    "Stream",
    "Index",
)
_BUILTINS1 = ("abs", "len", "int", "float", "str", "sorted", "sum")
_BUILTINS2 = ("min", "max", "round", "pow")
_OPS = (" + ", " - ", " * ", " // ", " % ")
_CMP = (" < ", " > ", " <= ", " >= ", " == ", " != ")


class _Rng:
    """SplitMix64: a 64-bit generator in integer arithmetic, identical on every platform and Python."""

    def __init__(self, seed: int):
        self.state = seed & _MASK

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n

    def pick(self, seq):
        return seq[self.next() % len(seq)]

    def chance(self, per_mille: int) -> bool:
        return self.next() % 1000 < per_mille


class _Writer:
    """One module's text: lines at an indentation, names in scope."""

    def __init__(self, rng: _Rng):
        self.rng, self.lines = rng, []

    def line(self, depth: int = 0, text: str = "") -> None:
        self.lines.append("    " * depth + text if text else "")

    # --- English ---

    def phrase(self) -> str:
        r = self.rng
        noun = r.pick(_NOUNS)
        if r.chance(500):
            return f"the {r.pick(_ADJECTIVES)} {noun}"
        return f"the {noun} of each {r.pick(_NOUNS)}"

    def sentence(self) -> str:
        r = self.rng
        verb = r.pick(_VERBS)
        text = f"{verb.capitalize()} {self.phrase()}"
        if r.chance(400):
            text += f" and {r.pick(_VERBS)} {self.phrase()}"
        if r.chance(300):
            text += f" for every {r.pick(_NOUNS)}"
        return text + "."

    # --- names and expressions ---

    def new_name(self, taken) -> str:
        r = self.rng
        for _ in range(8):
            name = r.pick(_NOUNS) if r.chance(500) else f"{r.pick(_ADJECTIVES)}_{r.pick(_NOUNS)}"
            if name not in taken:
                return name
        return f"{r.pick(_NOUNS)}_{len(taken)}"

    def atom(self, scope) -> str:
        r = self.rng
        k = r.below(10)
        if k < 6 and scope:
            return r.pick(scope)
        if k < 9:
            return str(r.below(100) if r.chance(800) else r.below(10000))
        return f"{r.below(100)}.{r.below(100):02d}"

    def expr(self, scope, depth: int = 0) -> str:
        r = self.rng
        k = r.below(10)
        if depth >= 2 or k < 3:
            return self.atom(scope)
        if k < 7:
            text = f"{self.expr(scope, depth + 1)}{r.pick(_OPS)}{self.expr(scope, depth + 1)}"
            return f"({text})" if depth else text
        if k < 9:
            return f"{r.pick(_BUILTINS2)}({self.expr(scope, depth + 1)}, {self.expr(scope, depth + 1)})"
        return f"{r.pick(_BUILTINS1)}({self.expr(scope, depth + 1)})"

    def check(self) -> str:
        """An ``assert`` with the right answer."""
        r = self.rng
        a, b = r.below(50), r.below(50)
        if r.chance(500):
            return f"assert {a} + {b} == {a + b}"
        if r.chance(500):
            return f"assert {a} * {b} == {a * b}"
        return f"assert max({a}, {b}) - min({a}, {b}) == {abs(a - b)}"

    # --- statements ---

    def block(self, depth: int, scope: list, budget: int) -> None:
        """``budget`` statements at ``depth``; names assigned here join ``scope``."""
        r = self.rng
        for _ in range(max(1, budget)):
            k = r.below(20)
            targets = [
                s for s in scope if s.isidentifier() and not s.isupper()
            ]  # no len(...), self.x, constants
            if k < 7 or not scope or (7 <= k < 10 and not targets):
                name = self.new_name(scope)
                self.line(depth, f"{name} = {self.expr(scope)}")
                scope.append(name)
            elif k < 10:
                self.line(depth, f"{r.pick(targets)} {r.pick(('+=', '-=', '*='))} {self.expr(scope, 1)}")
            elif k < 12 and depth < 4:
                self.line(depth, f"if {r.pick(scope)}{r.pick(_CMP)}{self.atom(scope)}:")
                self.block(depth + 1, list(scope), r.below(3) + 1)
                if r.chance(400):
                    self.line(depth, "else:")
                    self.block(depth + 1, list(scope), r.below(2) + 1)
            elif k < 14 and depth < 4:
                var = r.pick(("i", "j", "k", "n"))
                bound = r.pick(scope) if r.chance(500) else str(r.below(20) + 1)
                self.line(depth, f"for {var} in range({bound}):")
                self.block(depth + 1, scope + [var], r.below(3) + 1)
            elif k < 16:  # a comment, then the statement it is about (a block of comments alone is no block)
                self.line(depth, f"# {self.sentence()}")
                name = self.new_name(scope)
                self.line(depth, f"{name} = {self.expr(scope)}")
                scope.append(name)
            elif k < 17:
                self.line(depth, self.check())
            else:
                name = self.new_name(scope)
                source = r.pick(scope)
                self.line(depth, f"{name}s = [{source} * x for x in range({r.below(20) + 1})]")
                scope.append(f"len({name}s)")

    def function(
        self, depth: int, name: str, params: list[str], constants: list[str], method: bool = False
    ) -> None:
        r = self.rng
        args = (["self"] if method else []) + params
        self.line(depth, f"def {name}({', '.join(args)}):")
        if params and r.chance(600):
            self.line(depth + 1, f'"""{self.sentence()}')
            self.line()
            self.line(depth + 1, "Args:")
            for p in params:
                self.line(depth + 2, f"{p}: {self.phrase()}.")
            self.line(depth + 1, '"""')
        else:
            self.line(depth + 1, f'"""{self.sentence()}"""')
        scope = list(params) + list(constants) + ([f"self.{r.pick(_NOUNS)}"] if method else [])
        self.block(depth + 1, scope, r.below(6) + 2)
        self.line(depth + 1, f"return {self.expr(scope)}")

    def module(self) -> str:
        r = self.rng
        self.line(0, f'"""{self.sentence()}"""')
        self.line()
        for mod in sorted({r.pick(_MODULES) for _ in range(r.below(3) + 1)}):
            self.line(0, f"import {mod}")
        self.line()
        constants = []
        for _ in range(r.below(3)):
            const = r.pick(_NOUNS).upper()
            if const not in constants:
                constants.append(const)
                self.line(0, f"{const} = {r.below(1000)}")
        for _ in range(r.below(4) + 2):
            self.line()
            self.line()
            if r.chance(300):
                cls = r.pick(_ADJECTIVES).capitalize() + r.pick(_CLASS_PARTS)
                self.line(0, f"class {cls}:")
                self.line(1, f'"""{self.sentence()}"""')
                attrs = sorted({r.pick(_NOUNS) for _ in range(r.below(3) + 1)})
                self.line()
                self.line(1, f"def __init__(self, {', '.join(attrs)}):")
                for a in attrs:
                    self.line(2, f"self.{a} = {a}")
                for _ in range(r.below(3) + 1):
                    self.line()
                    params = sorted({r.pick(_NOUNS) for _ in range(r.below(3))})
                    self.function(1, f"{r.pick(_VERBS)}_{r.pick(_NOUNS)}", params, constants, method=True)
            else:
                params = sorted({r.pick(_NOUNS) for _ in range(r.below(4))})
                self.function(0, f"{r.pick(_VERBS)}_{r.pick(_NOUNS)}", params, constants)
        if r.chance(500):
            self.line()
            self.line()
            self.line(0, 'if __name__ == "__main__":')
            for _ in range(r.below(3) + 1):
                self.line(1, self.check())
        return "\n".join(self.lines) + "\n"


def generate_documents(count: int = DEFAULT_DOCUMENTS, seed: int = 0) -> list[tuple[str, str]]:
    """``count`` generated modules as ``(name, text)``, sorted by name; the same for the same arguments.

    Document ``i`` depends only on ``(seed, i)``: a larger ``count`` adds documents and changes none.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    docs = []
    for i in range(count):
        rng = _Rng((seed * 0x100000001B3 + i) * 0x9E3779B97F4A7C15 + VERSION)
        docs.append((f"synthetic/module_{i:05d}.py", _Writer(rng).module()))
    return docs
