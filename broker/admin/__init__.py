"""The admin console at /admin: server-rendered pages over the domain services.

``views`` holds the Flask blueprint, ``session`` the login (API key → JWT cookie) and
CSRF, ``service`` the admin actions (each one audited), ``disputes`` the dispute records
verification fills and admins judge.
"""
