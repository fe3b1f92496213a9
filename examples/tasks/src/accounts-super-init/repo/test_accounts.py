import unittest

from accounts import Account, SavingsAccount


class AccountTest(unittest.TestCase):
    def test_account(self):
        account = Account("ann", 10)
        account.deposit(5)
        account.withdraw(20)
        self.assertEqual(account.balance, -5)
        self.assertEqual(account.history, [("deposit", 5), ("withdraw", 20)])

    def test_savings_attributes(self):
        savings = SavingsAccount("bob", 100, rate=0.05)
        self.assertEqual((savings.owner, savings.balance, savings.rate), ("bob", 100, 0.05))


if __name__ == "__main__":
    unittest.main()
