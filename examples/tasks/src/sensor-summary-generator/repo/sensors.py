"""Temperature log summaries."""


def parse_readings(lines):
    """Yields the readings in `lines` as floats, skipping blank lines and '#' comments."""
    for line in lines:
        line = line.strip()
        if line and not line.startswith("#"):
            yield float(line)


def summarize(lines):
    """count, min, max and mean of the readings in `lines`; ValueError when there are none."""
    readings = parse_readings(lines)
    count = sum(1 for _ in readings)
    if count == 0:
        raise ValueError("no readings")
    return {
        "count": count,
        "min": min(readings),
        "max": max(readings),
        "mean": sum(readings) / count,
    }
