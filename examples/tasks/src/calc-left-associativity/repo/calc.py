"""A small arithmetic expression evaluator (tokenizer + recursive-descent parser)."""


class CalcError(ValueError):
    """The expression is malformed."""


def tokenize(text):
    """'2 * (3.5 + 4)' -> [2, '*', '(', 3.5, '+', 4, ')']."""
    tokens = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch.isspace():
            i += 1
        elif ch.isdigit() or ch == ".":
            j = i
            while j < len(text) and (text[j].isdigit() or text[j] == "."):
                j += 1
            literal = text[i:j]
            try:
                tokens.append(float(literal) if "." in literal else int(literal))
            except ValueError:
                raise CalcError(f"bad number {literal!r}") from None
            i = j
        elif ch in "+-*/()":
            tokens.append(ch)
            i += 1
        else:
            raise CalcError(f"unexpected character {ch!r} at position {i}")
    return tokens


class _Parser:
    def __init__(self, tokens):
        self.tokens = tokens
        self.pos = 0

    def peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def next(self):
        token = self.peek()
        self.pos += 1
        return token

    def expr(self):
        # expr := term (("+" | "-") term)*
        left = self.term()
        if self.peek() in ("+", "-"):
            op = self.next()
            right = self.expr()
            return left + right if op == "+" else left - right
        return left

    def term(self):
        # term := factor (("*" | "/") factor)*
        left = self.factor()
        if self.peek() in ("*", "/"):
            op = self.next()
            right = self.term()
            return left * right if op == "*" else left / right
        return left

    def factor(self):
        # factor := NUMBER | "-" factor | "(" expr ")"
        token = self.next()
        if token == "-":
            return -self.factor()
        if token == "(":
            value = self.expr()
            if self.next() != ")":
                raise CalcError("expected ')'")
            return value
        if isinstance(token, (int, float)):
            return token
        raise CalcError(f"unexpected token {token!r}")


def evaluate(text):
    parser = _Parser(tokenize(text))
    value = parser.expr()
    if parser.peek() is not None:
        raise CalcError(f"unexpected token {parser.peek()!r}")
    return value
