"""Who may do what and what they have used: tenants and their keys, authentication
(and its cross-gateway notifications), quotas and prices, and the usage rows.
"""
