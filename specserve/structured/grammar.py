"""vLLM's `guided_grammar`: a grammar in GBNF (llama.cpp's and xgrammar's EBNF), written
out as one regex that regex.py compiles.

A grammar is rules `name ::= body`, and the answer matches the rule `root`. A body is
alternatives (`|`) of sequences of: a literal in double (or single) quotes, with the
escapes `\\n \\r \\t \\\\ \\" \\xHH \\uHHHH \\UHHHHHHHH` and any escaped punctuation; a
character class `[...]` or `[^...]` with ranges and the same escapes; `.` (any
character); a rule's name; a group `( ... )`; each with an optional `*`, `+`, `?`,
`{m}`, `{m,}`, `{,n}` or `{m,n}`. `#` starts a comment that runs to the line's end, and
a rule runs over as many lines as it likes, up to the next `name ::=`.

Each rule is written into the regex wherever it is named, so a grammar is served where
its language is regular that way: a rule that refers to itself, directly or through
others, is a ConfigError naming the cycle, as is a grammar past MAX_REGEX_CHARS once
written out. Every other mistake (a missing `root`, a rule named but never defined or
defined twice, a syntax error) is a ConfigError naming its line and column.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.errors import ConfigError
from specserve.structured.regex import escaped, escaped_char

# A grammar written out past this many regex characters is refused: a rule named twice in
# each of a chain of rules doubles at each link.
MAX_REGEX_CHARS = 100_000
NAME_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
ESCAPES = {"n": "\n", "r": "\r", "t": "\t"}
HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}  # the digits each takes


@dataclass(frozen=True)
class _Token:
    kind: str  # "name", "define", "literal", "class", "any", "(", ")", "|", "quantifier"
    text: str  # a name; a literal's characters; a class's or a quantifier's regex
    at: int  # where it starts in the grammar


class _Scanner:
    """The grammar's text as tokens, each with its place for error messages."""

    def __init__(self, text: str):
        self.text, self.i = text, 0

    def where(self, at: int) -> str:
        line = self.text.count("\n", 0, at) + 1
        column = at - (self.text.rfind("\n", 0, at) + 1) + 1
        return f"line {line}, column {column}"

    def fail(self, message: str, at: int) -> ConfigError:
        return ConfigError(f"grammar {self.where(at)}: {message}")

    def tokens(self) -> list[_Token]:
        out: list[_Token] = []
        text = self.text
        while True:
            self._skip_space()
            if self.i >= len(text):
                return out
            at, c = self.i, text[self.i]
            if text.startswith("::=", at):
                self.i += 3
                out.append(_Token("define", "::=", at))
            elif c in NAME_CHARACTERS:
                while self.i < len(text) and text[self.i] in NAME_CHARACTERS:
                    self.i += 1
                out.append(_Token("name", text[at : self.i], at))
            elif c in "\"'":
                out.append(_Token("literal", self._literal(c), at))
            elif c == "[":
                out.append(_Token("class", self._class(), at))
            elif c == ".":
                self.i += 1
                out.append(_Token("any", "", at))
            elif c in "()|":
                self.i += 1
                out.append(_Token(c, c, at))
            elif c in "*+?":
                self.i += 1
                out.append(_Token("quantifier", c, at))
            elif c == "{":
                out.append(_Token("quantifier", self._counts(), at))
            else:
                raise self.fail(f"unexpected {c!r}", at)

    def _skip_space(self) -> None:
        text = self.text
        while self.i < len(text):
            if text[self.i].isspace():
                self.i += 1
            elif text[self.i] == "#":
                end = text.find("\n", self.i)
                self.i = len(text) if end < 0 else end
            else:
                return

    def _char(self) -> str:
        """One character of a literal or class, its escape read."""
        text, at = self.text, self.i
        if at >= len(text):
            raise self.fail("the grammar ends inside a literal or class", at)
        if text[at] != "\\":
            self.i += 1
            return text[at]
        if at + 1 >= len(text):
            raise self.fail("the grammar ends inside an escape", at)
        e = text[at + 1]
        if e in ESCAPES:
            self.i += 2
            return ESCAPES[e]
        if e in HEX_ESCAPES:
            digits = text[at + 2 : at + 2 + HEX_ESCAPES[e]]
            if len(digits) != HEX_ESCAPES[e] or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"\\{e} takes {HEX_ESCAPES[e]} hex digits", at)
            code = int(digits, 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                raise self.fail(f"\\{e}{digits} is not a character", at)
            self.i += 2 + len(digits)
            return chr(code)
        if not e.isalnum() and not e.isspace():
            self.i += 2
            return e
        raise self.fail(f"unknown escape \\{e}", at)

    def _literal(self, quote: str) -> str:
        start = self.i
        self.i += 1
        chars = []
        while self.i < len(self.text) and self.text[self.i] != quote:
            if self.text[self.i] == "\n":
                raise self.fail("a literal runs past its line's end (write a newline as \\n)", start)
            chars.append(self._char())
        if self.i >= len(self.text):
            raise self.fail("a literal is not closed", start)
        self.i += 1
        return "".join(chars)

    def _class(self) -> str:
        """A class `[...]`, as our regex dialect writes it."""
        start = self.i
        self.i += 1
        negated = self.text.startswith("^", self.i)
        self.i += negated
        items = []
        while self.i < len(self.text) and self.text[self.i] != "]":
            first = self._char()
            if self.text.startswith("-", self.i) and not self.text.startswith("-]", self.i):
                self.i += 1
                last = self._char()
                if ord(last) < ord(first):
                    raise self.fail(f"the range {first!r}-{last!r} runs backwards", start)
                items.append(f"{escaped_char(ord(first), in_class=True)}-{escaped_char(ord(last), in_class=True)}")
            else:
                items.append(escaped_char(ord(first), in_class=True))
        if self.i >= len(self.text):
            raise self.fail("a character class is not closed", start)
        self.i += 1
        if not items:
            raise self.fail("an empty character class", start)
        return "[" + "^" * negated + "".join(items) + "]"

    def _counts(self) -> str:
        """A repetition `{m}`, `{m,}`, `{,n}` or `{m,n}`, checked."""
        start = self.i
        end = self.text.find("}", start)
        body = self.text[start + 1 : end] if end > 0 else ""
        parts = body.replace(" ", "").split(",")
        if end < 0 or len(parts) > 2 or not all(p.isdigit() or p == "" for p in parts) or not any(parts):
            raise self.fail("a repetition is {m}, {m,}, {,n} or {m,n}", start)
        if len(parts) == 2 and parts[0] and parts[1] and int(parts[0]) > int(parts[1]):
            raise self.fail(f"the repetition {{{body}}} allows fewer than it needs", start)
        self.i = end + 1
        return "{" + ",".join(parts) + "}"


class _Rules:
    """The rules' bodies as token lists, parsed and written out as regexes on demand."""

    def __init__(self, scanner: _Scanner, tokens: list[_Token]):
        self.scanner = scanner
        starts = [i for i in range(len(tokens) - 1) if tokens[i].kind == "name" and tokens[i + 1].kind == "define"]
        if not starts or starts[0] != 0:
            raise scanner.fail("expected a rule, `name ::= ...`", tokens[0].at)
        self.bodies: dict[str, list[_Token]] = {}
        self.defined_at: dict[str, int] = {}
        for n, i in enumerate(starts):
            name = tokens[i].text
            if name in self.bodies:
                raise scanner.fail(
                    f"the rule {name!r} is defined again (first at {scanner.where(self.defined_at[name])})",
                    tokens[i].at,
                )
            self.bodies[name] = tokens[i + 2 : starts[n + 1] if n + 1 < len(starts) else len(tokens)]
            self.defined_at[name] = tokens[i].at
        self.written: dict[str, str] = {}
        self.writing: list[str] = []  # the rules being written, outermost first

    def regex(self, name: str, named_at: int) -> str:
        """The rule written out; ConfigError where it is undefined or refers to itself."""
        if name in self.written:
            return self.written[name]
        if name not in self.bodies:
            raise self.scanner.fail(f"the rule {name!r} is not defined", named_at)
        if name in self.writing:
            cycle = " -> ".join([*self.writing[self.writing.index(name) :], name])
            raise ConfigError(
                f"the grammar's rule {name!r} refers to itself ({cycle}); grammars are served where no rule "
                "does, as a regex: write its levels out to the depth the answer needs"
            )
        self.writing.append(name)
        body = self.bodies[name]
        if not body:
            raise self.scanner.fail(f"the rule {name!r} is empty", self.defined_at[name])
        regex, end = self._alternatives(body, 0)
        if end < len(body):
            raise self.scanner.fail(f"unexpected {body[end].text!r}", body[end].at)
        self.writing.pop()
        if len(regex) > MAX_REGEX_CHARS:
            raise ConfigError(
                f"the grammar's rule {name!r} writes out to {len(regex):,} regex characters, past the limit of "
                f"{MAX_REGEX_CHARS:,}; name fewer rules inside rules named many times"
            )
        self.written[name] = regex
        return regex

    def _alternatives(self, body: list[_Token], i: int) -> tuple[str, int]:
        options = []
        while True:
            sequence, i = self._sequence(body, i)
            options.append(sequence)
            if i < len(body) and body[i].kind == "|":
                i += 1
                continue
            return (options[0] if len(options) == 1 else "(?:" + "|".join(options) + ")"), i

    def _sequence(self, body: list[_Token], i: int) -> tuple[str, int]:
        items = []
        while i < len(body) and body[i].kind not in ("|", ")"):
            token = body[i]
            if token.kind == "quantifier":
                raise self.scanner.fail(f"{token.text!r} follows nothing it could repeat", token.at)
            if token.kind == "literal":
                atom = escaped(token.text)
                single = len(token.text) == 1
            elif token.kind == "class":
                atom, single = token.text, True
            elif token.kind == "any":
                atom, single = "(?:.|\\n)", True
            elif token.kind == "name":
                atom, single = "(?:" + self.regex(token.text, token.at) + ")", True
            elif token.kind == "(":
                inner, i = self._alternatives(body, i + 1)
                if i >= len(body) or body[i].kind != ")":
                    raise self.scanner.fail("a group is not closed", token.at)
                atom, single = "(?:" + inner + ")", True
            else:
                raise self.scanner.fail(f"unexpected {token.text!r}", token.at)
            i += 1
            while i < len(body) and body[i].kind == "quantifier":
                atom = (atom if single else "(?:" + atom + ")") + body[i].text
                single = False
                i += 1
            items.append(atom)
        return "".join(items), i


def grammar_regex(grammar: str) -> str:
    """The regex of the answers `grammar` (GBNF, from its rule `root`) accepts; ConfigError
    naming the mistake where it is not one, or not one served (module docstring)."""
    if "::=" not in grammar:
        hint = " (Lark grammars are not read)" if ":" in grammar else ""
        raise ConfigError(f"a grammar is rules written `name ::= ...`, one of them `root`{hint}")
    scanner = _Scanner(grammar)
    rules = _Rules(scanner, scanner.tokens())
    if "root" not in rules.bodies:
        raise ConfigError(f"the grammar has no rule `root` (it defines {', '.join(sorted(rules.bodies))})")
    return rules.regex("root", rules.defined_at["root"])
