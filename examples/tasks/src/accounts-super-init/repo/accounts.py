"""Bank accounts."""


class Account:
    def __init__(self, owner, balance=0):
        self.owner = owner
        self.balance = balance
        self.history = []

    def deposit(self, amount):
        if amount <= 0:
            raise ValueError("deposit must be positive")
        self.balance += amount
        self.history.append(("deposit", amount))

    def withdraw(self, amount):
        if amount <= 0:
            raise ValueError("withdrawal must be positive")
        self.balance -= amount
        self.history.append(("withdraw", amount))


class SavingsAccount(Account):
    """An account that earns interest and cannot be overdrawn."""

    def __init__(self, owner, balance=0, rate=0.02):
        self.owner = owner
        self.balance = balance
        self.rate = rate

    def add_interest(self):
        """Deposits one period's interest (rounded to cents) and returns it."""
        interest = round(self.balance * self.rate, 2)
        if interest > 0:
            self.deposit(interest)
        return interest

    def withdraw(self, amount):
        if amount > self.balance:
            raise ValueError("insufficient funds")
        super().withdraw(amount)
