"""Development tools that are not part of the product (not in the wheel)."""
