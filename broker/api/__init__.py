"""The REST API (Flask blueprints). Views translate HTTP into service calls and back."""
