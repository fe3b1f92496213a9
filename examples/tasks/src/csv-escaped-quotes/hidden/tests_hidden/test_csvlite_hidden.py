import unittest

from csvlite import parse_line, read_records


class QuotesTest(unittest.TestCase):
    def test_doubled_quotes(self):
        self.assertEqual(parse_line('1,"say ""hi""",x'), ["1", 'say "hi"', "x"])

    def test_only_a_quote(self):
        self.assertEqual(parse_line('""""'), ['"'])

    def test_empty_quoted(self):
        self.assertEqual(parse_line('"",a'), ["", "a"])

    def test_semicolon_delimiter(self):
        self.assertEqual(parse_line('a;"b;""c""";d', delimiter=";"), ["a", 'b;"c"', "d"])

    def test_unterminated(self):
        with self.assertRaises(ValueError):
            parse_line('a,"b')

    def test_records_with_quotes(self):
        text = 'id,quote\n7,"He said ""no"", twice"\n'
        self.assertEqual(read_records(text), [{"id": "7", "quote": 'He said "no", twice'}])
