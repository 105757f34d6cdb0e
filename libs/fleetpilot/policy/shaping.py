"""Traffic shaping: safe conditions on tasks and deterministic routing to candidate policies.

Conditions are a tiny language, parsed by a tokenizer and a recursive-descent parser into an
AST of plain nodes and evaluated by walking it — never ``eval``/``exec``/``ast``::

    task.kind == 'finetune' and task.size_gb > 5
    task.labels.team in ['vision', 'speech'] or not task.sla.tier == 'vip'

Grammar (lowest precedence first)::

    expr    := or
    or      := and ('or' and)*
    and     := not ('and' not)*
    not     := 'not' not | cmp
    cmp     := operand (('=='|'!='|'<'|'<='|'>'|'>='|'in'|'not' 'in') operand)?
    operand := STRING | NUMBER | 'true' | 'false' | 'none' | path | list | '(' expr ')'
    path    := 'task' ('.' NAME)*
    list    := '[' (operand (',' operand)*)? ']'

A bad condition raises ``ConditionSyntaxError`` with the character position. A path that
does not exist on the task evaluates to ``None`` (so ``task.labels.team == 'x'`` is simply
false for a task without that label); comparing incompatible types is false, not an error.

Routing: ``Router(rules)`` maps each task to one number ``u = sha256(salt + task_id)`` in
[0, 1) and walks the rules in order; each rule whose condition holds takes the next ``weight``
of the unit interval, and the task goes to the rule whose slice holds ``u`` — so a task always
lands in the same shard, and ``weight`` of the tasks matching a rule take it, whatever other
rules they match before it (as long as the weights of the rules one task matches add up to
no more than 1; past that, the later rules get what is left).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

KEYWORDS = {"and", "or", "not", "in", "true", "false", "none"}
MAX_NESTING = 64
"""How deep ``not``, parentheses and lists may nest: the parser recurses per level, and a
condition past Python's stack failed with a ``RecursionError`` instead of a syntax error."""
_OPS = ("==", "!=", "<=", ">=", "<", ">")


class ConditionSyntaxError(ValueError):
    """A condition that does not parse; ``pos`` is the 0-based character offset."""

    def __init__(self, message: str, pos: int, text: str) -> None:
        super().__init__(f"{message} at position {pos}: {text[:pos]}\u2038{text[pos:]}")
        self.pos = pos


@dataclass(frozen=True)
class Token:
    """One lexical token: ``kind`` is one of name, keyword, string, number, op, punct, end."""

    kind: str
    value: Any
    pos: int


def tokenize(text: str) -> list[Token]:
    """Split a condition into tokens; raises ``ConditionSyntaxError`` on a stray character."""
    out: list[Token] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif c in "'\"":
            j, buf = i + 1, []
            while j < n and text[j] != c:
                if text[j] == "\\" and j + 1 < n:
                    j += 1
                buf.append(text[j])
                j += 1
            if j >= n:
                raise ConditionSyntaxError("unterminated string", i, text)
            out.append(Token("string", "".join(buf), i))
            i = j + 1
        elif c.isdigit() or (c == "-" and i + 1 < n and text[i + 1].isdigit()):
            j = i + 1
            while j < n and (text[j].isdigit() or text[j] in "._eE" or (text[j] in "+-" and text[j - 1] in "eE")):
                j += 1
            raw = text[i:j].replace("_", "")
            try:
                value: Any = int(raw) if raw.lstrip("-").isdigit() else float(raw)
            except ValueError:
                raise ConditionSyntaxError(f"bad number {text[i:j]!r}", i, text) from None
            out.append(Token("number", value, i))
            i = j
        elif c.isalpha() or c == "_":
            j = i + 1
            while j < n and (text[j].isalnum() or text[j] == "_"):
                j += 1
            word = text[i:j]
            out.append(Token("keyword" if word.lower() in KEYWORDS else "name",
                             word.lower() if word.lower() in KEYWORDS else word, i))
            i = j
        elif text.startswith(_OPS, i):
            op = next(o for o in _OPS if text.startswith(o, i))
            out.append(Token("op", op, i))
            i += len(op)
        elif c in "().,[]":
            out.append(Token("punct", c, i))
            i += 1
        else:
            raise ConditionSyntaxError(f"unexpected character {c!r}", i, text)
    out.append(Token("end", None, n))
    return out


# AST nodes: plain tuples, ("lit", v) ("path", (names...)) ("list", [nodes]) ("not", x)
# ("and", [nodes]) ("or", [nodes]) ("cmp", op, a, b). A chain of ``and`` / ``or`` is one flat
# node, evaluated in a loop: nested pairwise, a generated rule of a thousand alternatives
# recursed once per term and every task routed through it raised ``RecursionError``.
Node = tuple[Any, ...]


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = tokenize(text)
        self.i = 0
        self.depth = 0

    def peek(self) -> Token:
        return self.toks[self.i]

    def take(self) -> Token:
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def error(self, message: str, tok: Token | None = None) -> ConditionSyntaxError:
        tok = tok or self.peek()
        return ConditionSyntaxError(message, tok.pos, self.text)

    def expect(self, kind: str, value: Any) -> Token:
        tok = self.peek()
        if tok.kind != kind or tok.value != value:
            raise self.error(f"expected {value!r}")
        return self.take()

    def parse(self) -> Node:
        if self.peek().kind == "end":
            raise self.error("empty condition")
        node = self.parse_or()
        if self.peek().kind != "end":
            raise self.error(f"unexpected {self.peek().value!r}")
        return node

    def parse_or(self) -> Node:
        terms = [self.parse_and()]
        while self.peek().kind == "keyword" and self.peek().value == "or":
            self.take()
            terms.append(self.parse_and())
        return terms[0] if len(terms) == 1 else ("or", terms)

    def parse_and(self) -> Node:
        terms = [self.parse_not()]
        while self.peek().kind == "keyword" and self.peek().value == "and":
            self.take()
            terms.append(self.parse_not())
        return terms[0] if len(terms) == 1 else ("and", terms)

    def nest(self, tok: Token) -> None:
        """Enter one more level of ``not``, parentheses or a list (``MAX_NESTING``)."""
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise self.error(f"condition nested too deeply (more than {MAX_NESTING} levels)", tok)

    def parse_not(self) -> Node:
        tok = self.peek()
        if tok.kind == "keyword" and tok.value == "not":
            self.take()
            self.nest(tok)
            node = ("not", self.parse_not())
            self.depth -= 1
            return node
        return self.parse_cmp()

    def parse_cmp(self) -> Node:
        left = self.parse_operand()
        tok = self.peek()
        if tok.kind == "op":
            self.take()
            return ("cmp", tok.value, left, self.parse_operand())
        if tok.kind == "keyword" and tok.value == "in":
            self.take()
            return ("cmp", "in", left, self.parse_operand())
        if tok.kind == "keyword" and tok.value == "not" and self.toks[self.i + 1].value == "in":
            self.take()
            self.take()
            return ("cmp", "not in", left, self.parse_operand())
        return left

    def parse_operand(self) -> Node:
        tok = self.take()
        if tok.kind in ("string", "number"):
            return ("lit", tok.value)
        if tok.kind == "keyword" and tok.value in ("true", "false", "none"):
            return ("lit", {"true": True, "false": False, "none": None}[tok.value])
        if tok.kind == "punct" and tok.value == "(":
            self.nest(tok)
            node = self.parse_or()
            self.expect("punct", ")")
            self.depth -= 1
            return node
        if tok.kind == "punct" and tok.value == "[":
            self.nest(tok)
            items: list[Node] = []
            if not (self.peek().kind == "punct" and self.peek().value == "]"):
                items.append(self.parse_operand())
                while self.peek().kind == "punct" and self.peek().value == ",":
                    self.take()
                    items.append(self.parse_operand())
            self.expect("punct", "]")
            self.depth -= 1
            return ("list", items)
        if tok.kind == "name":
            if tok.value != "task":
                raise self.error(f"unknown name {tok.value!r} (paths start with 'task')", tok)
            parts: list[str] = []
            while self.peek().kind == "punct" and self.peek().value == ".":
                self.take()
                name = self.take()
                if name.kind not in ("name", "keyword"):
                    raise self.error("expected an attribute name after '.'", name)
                parts.append(str(name.value))
            return ("path", tuple(parts))
        if tok.kind == "end":
            raise self.error("unexpected end of condition", tok)
        raise self.error(f"unexpected {tok.value!r}", tok)


def _resolve(task: Any, parts: Sequence[str]) -> Any:
    value = task
    for part in parts:
        if part.startswith("_"):
            return None  # never reach into private attributes
        if isinstance(value, Mapping):
            value = value.get(part)
        elif isinstance(value, msgspec.Struct) or hasattr(value, "__dataclass_fields__"):
            value = getattr(value, part, None)
        else:
            return None
        if value is None:
            return None
    return value


def _compare(op: str, a: Any, b: Any) -> bool:
    try:
        if op == "==":
            return bool(a == b)
        if op == "!=":
            return bool(a != b)
        if op == "in":
            return b is not None and a in b
        if op == "not in":
            return b is not None and a not in b
        if a is None or b is None or isinstance(a, bool) != isinstance(b, bool):
            return False
        if op == "<":
            return bool(a < b)
        if op == "<=":
            return bool(a <= b)
        if op == ">":
            return bool(a > b)
        if op == ">=":
            return bool(a >= b)
    except TypeError:
        return False
    raise ValueError(f"unknown operator {op}")  # pragma: no cover - the parser emits only these


def _evaluate(node: Node, task: Any) -> Any:
    kind = node[0]
    if kind == "lit":
        return node[1]
    if kind == "path":
        return _resolve(task, node[1])
    if kind == "list":
        return [_evaluate(x, task) for x in node[1]]
    if kind == "not":
        return not _truth(_evaluate(node[1], task))
    if kind == "and":
        return all(_truth(_evaluate(x, task)) for x in node[1])
    if kind == "or":
        return any(_truth(_evaluate(x, task)) for x in node[1])
    return _compare(node[1], _evaluate(node[2], task), _evaluate(node[3], task))


def _truth(value: Any) -> bool:
    return bool(value)


class Condition:
    """A parsed condition; ``Condition(text)(task) -> bool``. Parses once, evaluates often."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.ast = _Parser(text).parse()

    def __call__(self, task: Any) -> bool:
        """True when the condition holds for ``task`` (a struct, dataclass or mapping)."""
        return _truth(_evaluate(self.ast, task))

    def __repr__(self) -> str:
        return f"Condition({self.text!r})"


def parse_condition(text: str) -> Condition:
    """Parse a condition (raises ``ConditionSyntaxError`` with the position on bad syntax)."""
    return Condition(text)


class RouteRule(msgspec.Struct, frozen=True, kw_only=True):
    """Send ``weight`` (0..1) of the tasks matching ``condition`` to ``policy``, tagged
    ``shard`` (default: ``<policy>``)."""

    condition: str = "true"
    weight: float = 1.0
    policy: str
    shard: str = ""


def hash_unit(task_id: str, salt: str = "") -> float:
    """A uniform number in [0, 1) from ``sha256(salt + task_id)``: the same task, the same u."""
    digest = hashlib.sha256((salt + task_id).encode()).digest()
    # 53 bits, exactly representable: 64 bits divided by 2**64 rounded the top 1024 values
    # to 1.0, a task no rule of weight 1 would take.
    return (int.from_bytes(digest[:8], "big") >> 11) / 2.0**53


class Router:
    """Deterministic traffic shaping over ordered rules; the default policy takes the rest.

    One hash per task, ``u = hash_unit(task_id, salt + "0:")``; the rules whose condition
    holds for the task lay their weights end to end over [0, 1) in order, and the task goes
    to the rule whose slice holds ``u``. So each rule takes ``weight`` of the tasks it
    matches even when an earlier rule matches them too. Before, each rule drew its own hash
    and only saw the tasks the earlier rules had left: two canaries of 10% on one condition
    got 10% and 9%, a 50/50 split 50% and 25%. A single rule routes as it did then. Returns
    ``(policy, shard_id)``; the default's shard is ``"primary"``.
    """

    def __init__(self, rules: Sequence[RouteRule], default: str, salt: str = "") -> None:
        for r in rules:
            if not 0.0 <= r.weight <= 1.0:
                raise ValueError(f"rule weight {r.weight} is not in 0..1")
        self.rules = [(parse_condition(r.condition), r) for r in rules]
        self.default = default
        self.salt = salt

    def route(self, task: Any) -> tuple[str, str]:
        """The policy name and shard id for ``task`` (which needs a ``task_id``)."""
        task_id = str(_resolve(task, ["task_id"]) or "")
        u = hash_unit(task_id, f"{self.salt}0:")
        start = 0.0
        for cond, rule in self.rules:
            if not cond(task):
                continue
            if start <= u < start + rule.weight:
                return rule.policy, rule.shard or rule.policy
            start += rule.weight
            if start >= 1.0:
                break
        return self.default, "primary"
