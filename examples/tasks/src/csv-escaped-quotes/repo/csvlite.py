"""A small CSV reader."""


def parse_line(line, delimiter=","):
    """Splits one CSV line into fields. A field may be enclosed in double quotes; inside quotes
    the delimiter is literal and a doubled quote ("") stands for one quote character."""
    fields = []
    field = []
    in_quotes = False
    i = 0
    while i < len(line):
        ch = line[i]
        if in_quotes:
            if ch == '"':
                in_quotes = False
            else:
                field.append(ch)
        elif ch == '"':
            in_quotes = True
        elif ch == delimiter:
            fields.append("".join(field))
            field = []
        else:
            field.append(ch)
        i += 1
    if in_quotes:
        raise ValueError("unterminated quoted field")
    fields.append("".join(field))
    return fields


def read_records(text, delimiter=","):
    """The rows of `text` after the header line, as dicts keyed by the header's fields."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    header = parse_line(lines[0], delimiter)
    records = []
    for number, line in enumerate(lines[1:], start=2):
        values = parse_line(line, delimiter)
        if len(values) != len(header):
            raise ValueError(f"line {number}: expected {len(header)} fields, got {len(values)}")
        records.append(dict(zip(header, values)))
    return records
