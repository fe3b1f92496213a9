"""Plain-text invoices."""

from money import format_money


def render(customer, lines):
    """`lines` are (description, quantity, unit price in cents). Returns the invoice text."""
    out = [f"Invoice for {customer}"]
    total = 0
    for description, quantity, unit_cents in lines:
        amount = quantity * unit_cents
        total += amount
        out.append(f"{description:<20} {quantity:>3} x {format_money(unit_cents):>10} = {format_money(amount):>12}")
    out.append(f"{'TOTAL':<39} {format_money(total):>12}")
    return "\n".join(out)
