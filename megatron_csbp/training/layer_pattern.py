"""A per-layer pattern flag (`--moe-layer-freq`, `--window-attn-skip-freq`) read as Megatron-LM reads it, without
running it.

Megatron-LM's `moe_freq_type` takes an integer, or evaluates the text as Python once it holds nothing but
digits, `,`, `[`, `]`, `(`, `)`, `+` and `*`: a malformed text is a SyntaxError there, and `[1]*10**12` takes
all the memory there is. Here the same expressions are parsed by this grammar, every number and list bounded by
`rules.MAX_LAYERS` as it is built, so a text is either the value Python gives it or one line saying why not:

    sum     := product ("+" product)*
    product := power ("*" power)*
    power   := atom ("**" power)?                       integers only
    atom    := INTEGER | "[" [sum ("," sum)* [","]] "]" | "(" sum ")"

`+` adds integers or joins lists, `*` multiplies integers or repeats a list, and the list must hold one 0
(dense) or 1 (MoE) per layer. A text without `[` is an integer, as `int()` reads it (Megatron-LM's reading).
"""

import re

from megatron_csbp.core.rules import MAX_LAYERS, ConfigError

HINT = "give an int N or a list of one 0 or 1 per layer, e.g. [0,1,1,1] or ([0]+[1]*3)*2"
# what 0 and 1 mean, by flag (default: MoE's)
MEANINGS = {"window-attn-skip-freq": "0 (global) or 1 (sliding)",
            "linear-attention-freq": "1 (Gated DeltaNet) or 0 (full attention)"}
MAX_NESTING = 32  # brackets and powers inside one another (each level is a few frames of the parser's stack)
_TOKEN = re.compile(r"\s*(\d+|\*\*|[][()+*,])")


class _Refused(Exception):
    """Why the text is not a pattern (the caller adds the flag and the text)."""


def _tokens(text: str) -> list[tuple[str, int]]:
    """(token, position) pairs, then ("", end)."""
    found, at = [], 0
    while text[at:].strip():
        match = _TOKEN.match(text, at)
        if match is None:
            at += len(text[at:]) - len(text[at:].lstrip())
            raise _Refused(f"{text[at]!r} at character {at + 1} is not part of a pattern (digits , [ ] ( ) + *)")
        token, at = match.group(1), match.end()
        if token.isdigit():
            if len(token) > 1 and token[0] == "0":
                raise _Refused(f"the number {token} has a leading zero (Python refuses it)")
            if len(token) > len(str(MAX_LAYERS)) or int(token) > MAX_LAYERS:
                raise _Refused(f"the number {token[:20]}{'...' if len(token) > 20 else ''} exceeds {MAX_LAYERS}")
        found.append((token, match.start(1)))
    return found + [("", len(text))]


def _bounded(value):
    size = len(value) if isinstance(value, list) else value
    if size > MAX_LAYERS:
        raise _Refused(f"it builds {'a list of ' if isinstance(value, list) else 'the number '}{size}"
                       f"{' layers' if isinstance(value, list) else ''}, more than {MAX_LAYERS}")
    return value


def _plus(left, right):
    if isinstance(left, list) != isinstance(right, list):
        raise _Refused("'+' joins two lists or adds two numbers, not a list and a number")
    return _bounded(left + right)


def _times(left, right):
    if isinstance(left, list) and isinstance(right, list):
        raise _Refused("'*' repeats a list a number of times; two lists cannot be multiplied")
    if isinstance(left, list) or isinstance(right, list):
        items, count = (left, right) if isinstance(left, list) else (right, left)
        if len(items) * count > MAX_LAYERS:
            raise _Refused(f"it builds a list of {len(items) * count} layers, more than {MAX_LAYERS}")
        return items * count
    return _bounded(left * right)


def _power(base, exponent):
    if isinstance(base, list) or isinstance(exponent, list):
        raise _Refused("'**' raises a number to a power, not a list")
    if base > 1 and exponent > MAX_LAYERS.bit_length():
        raise _Refused(f"{base}**{exponent} exceeds {MAX_LAYERS}")
    return _bounded(base ** exponent)


class _Parser:
    def __init__(self, text: str):
        self.tokens, self.at, self.depth = _tokens(text), 0, 0

    def peek(self) -> str:
        return self.tokens[self.at][0]

    def take(self, token: str) -> bool:
        if self.peek() != token:
            return False
        self.at += 1
        return True

    def where(self) -> str:
        token, position = self.tokens[self.at]
        return f"{token!r} at character {position + 1}" if token else "the end"

    def close(self, token: str, opened: int) -> None:
        if not self.take(token):
            opener = "(" if token == ")" else "["
            raise _Refused(f"the {opener!r} at character {opened + 1} is not closed: {self.where()} where {token!r} "
                           f"should be")

    def end(self) -> None:
        if self.peek():
            raise _Refused(f"{self.where()} follows a whole expression")

    def nested(self):
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise _Refused(f"brackets or powers are nested more than {MAX_NESTING} deep")

    def sum(self):
        value = self.product()
        while self.take("+"):
            value = _plus(value, self.product())
        return value

    def product(self):
        value = self.power()
        while self.take("*"):
            value = _times(value, self.power())
        return value

    def power(self):
        base = self.atom()
        if self.take("**"):
            self.nested()
            base = _power(base, self.power())
            self.depth -= 1
        return base

    def atom(self):
        token, position = self.tokens[self.at]
        if token.isdigit():
            self.at += 1
            return int(token)
        if token not in ("(", "["):
            raise _Refused(f"expected a number, '[' or '(', found {self.where()}")
        self.at += 1
        self.nested()
        if token == "(":
            value = self.sum()
            self.close(")", position)
        else:
            value = []
            while self.peek() != "]":
                item = self.sum()
                if isinstance(item, list):
                    raise _Refused(f"the list at character {position + 1} holds a list; it holds one 0 or 1 per layer")
                value.append(item)
                _bounded(value)
                if not self.take(","):
                    break
            self.close("]", position)
        self.depth -= 1
        return value


def parse(text, flag: str = "--moe-layer-freq") -> int | list[int]:
    """`text` (or an int) as Megatron-LM's type reads it: an int, or a list of one 0 or 1 per layer; refuses
    anything else (`ConfigError`, one line naming `flag`)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    text = str(text)
    shown = text if len(text) <= 60 else text[:57] + "..."
    try:
        if "[" not in text:
            try:
                return int(text)
            except ValueError:
                raise _Refused("not an integer, and no list") from None
        parser = _Parser(text)
        value = parser.sum()
        parser.end()
        if not isinstance(value, list):
            raise _Refused("it is a number, not a list")
        wrong = next((index for index, item in enumerate(value) if item not in (0, 1)), None)
        if wrong is not None:
            raise _Refused(f"layer {wrong} is {value[wrong]}; each layer is "
                           f"{MEANINGS.get(flag.strip(chr(39) + '-'), '0 (dense) or 1 (MoE)')}")
        return value
    except _Refused as why:
        raise ConfigError(f"{flag} {shown!r}: {why}; {HINT}") from None


def canonical(value) -> str:
    """A parsed pattern as Megatron-LM's type takes it: a plain list without spaces, or the int."""
    return str(value).replace(" ", "")
