"""Settings of a minimal Django project that runs anarchon (python manage.py runscheduler)."""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "only-for-this-example")
DEBUG = False
ALLOWED_HOSTS = ["localhost", "127.0.0.1"]
INSTALLED_APPS = ["django.contrib.sessions", "jobs"]
ROOT_URLCONF = "mysite.urls"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("DJANGO_DB", BASE_DIR / "db.sqlite3"),
    }
}
USE_TZ = True
TIME_ZONE = "UTC"

# anarchon: where the scheduler keeps its state.
ANARCHON_REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
ANARCHON_PREFIX = os.environ.get("ANARCHON_PREFIX", "mysite:")  # one prefix per application

# anarchon logs each run, and each error, on the logger "anarchon".
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s [%(process)d] %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "anarchon": {"handlers": ["console"], "level": "INFO", "propagate": False},
        "jobs": {"handlers": ["console"], "level": "INFO", "propagate": False},
    },
}
