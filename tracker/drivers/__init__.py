"""Drivers: run the core's steps on the caller's connection (psycopg sync, psycopg async, asyncpg)."""
