"""Timesheet lines: 'YYYY-MM-DD,hours'."""

from datetime import datetime

DATE_FORMAT = "%Y-%M-%d"


def parse_day(text):
    """'2024-03-05' -> datetime.date(2024, 3, 5)."""
    return datetime.strptime(text.strip(), DATE_FORMAT).date()


def hours_by_month(lines):
    """Total hours per month, keyed 'YYYY-MM', in order of first appearance."""
    totals = {}
    for line in lines:
        if not line.strip():
            continue
        day, hours = line.split(",")
        key = parse_day(day).strftime("%Y-%m")
        totals[key] = totals.get(key, 0.0) + float(hours)
    return totals


def days_between(start, end):
    return (parse_day(end) - parse_day(start)).days
