import unittest
from datetime import date

from timesheet import days_between, hours_by_month, parse_day


class MonthTest(unittest.TestCase):
    def test_parse_day_month(self):
        self.assertEqual(parse_day("2024-03-05"), date(2024, 3, 5))
        self.assertEqual(parse_day(" 1999-12-31 "), date(1999, 12, 31))

    def test_hours_by_month(self):
        lines = ["2024-02-28,8", "2024-03-01,6", "2024-03-04,7.5", "2024-02-29,2"]
        self.assertEqual(hours_by_month(lines), {"2024-02": 10.0, "2024-03": 13.5})

    def test_days_between(self):
        self.assertEqual(days_between("2024-01-31", "2024-03-01"), 30)
