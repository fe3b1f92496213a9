import unittest

from csvlite import parse_line, read_records


class CsvTest(unittest.TestCase):
    def test_plain(self):
        self.assertEqual(parse_line("a,b,,c"), ["a", "b", "", "c"])

    def test_quoted_delimiter(self):
        self.assertEqual(parse_line('a,"b,c",d'), ["a", "b,c", "d"])

    def test_records(self):
        self.assertEqual(read_records("id,name\n1,ann\n"), [{"id": "1", "name": "ann"}])


if __name__ == "__main__":
    unittest.main()
