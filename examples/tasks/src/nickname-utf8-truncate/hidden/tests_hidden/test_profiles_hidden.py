import unittest

from profiles import clean_nickname, truncate_utf8


class Utf8Test(unittest.TestCase):
    def test_accented_nickname_fits(self):
        nick = clean_nickname("Zoë Ørsted-Åberg")
        self.assertLessEqual(len(nick.encode("utf-8")), 16)
        self.assertEqual(nick, "Zoë Ørsted-Åb")

    def test_no_half_characters(self):
        self.assertEqual(truncate_utf8("ééééé", 5), "éé")
        self.assertEqual(truncate_utf8("a\U0001F600b", 3), "a")

    def test_exact_fit_kept(self):
        self.assertEqual(truncate_utf8("日本語", 9), "日本語")
        self.assertEqual(truncate_utf8("日本語", 8), "日本")
