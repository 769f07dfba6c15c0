"""WSGI entry point for gunicorn: ``gunicorn -c gunicorn.conf.py wsgi:app``."""

from webapp import create_app

app = create_app()
