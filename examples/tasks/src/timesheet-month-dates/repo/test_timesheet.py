import unittest
from datetime import date

from timesheet import hours_by_month, parse_day


class TimesheetTest(unittest.TestCase):
    def test_parse_day(self):
        self.assertEqual(parse_day("2024-01-15"), date(2024, 1, 15))

    def test_blank_lines_ignored(self):
        self.assertEqual(hours_by_month(["2023-01-02,7.5", "", "2023-01-03,1"]), {"2023-01": 8.5})


if __name__ == "__main__":
    unittest.main()
