"""textkit: small text helpers."""
