"""Money in and out of Sparecycles: Stripe Checkout purchases, Stripe Connect payouts, and the
``dev`` funding backend (admin grants) when no Stripe keys are configured (DESIGN §5).

:class:`PaymentService` is plain Python over two ports: a :class:`PaymentGateway` (Stripe,
see ``stripe_gateway.py``) and a payments repository (SQL, ``broker/storage/payments_sql.py``).
"""
from broker.payments.service import PaymentService

__all__ = ["PaymentService"]
