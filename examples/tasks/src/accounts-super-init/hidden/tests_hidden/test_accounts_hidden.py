import unittest

from accounts import Account, SavingsAccount


class SavingsTest(unittest.TestCase):
    def test_deposit_recorded(self):
        savings = SavingsAccount("bob", 100)
        savings.deposit(50)
        self.assertEqual(savings.balance, 150)
        self.assertEqual(savings.history, [("deposit", 50)])

    def test_interest(self):
        savings = SavingsAccount("cy", 200, rate=0.05)
        self.assertEqual(savings.add_interest(), 10.0)
        self.assertEqual(savings.balance, 210.0)

    def test_no_overdraft(self):
        savings = SavingsAccount("dee", 30)
        savings.withdraw(30)
        self.assertEqual(savings.history, [("withdraw", 30)])
        with self.assertRaises(ValueError):
            savings.withdraw(1)

    def test_is_an_account(self):
        self.assertIsInstance(SavingsAccount("eve"), Account)
        self.assertEqual(SavingsAccount("eve").history, [])
