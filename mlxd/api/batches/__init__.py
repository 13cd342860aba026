"""The Batch API: ``/v1/files`` and ``/v1/batches``, durable in SQLite, run in idle time.

store/db (the state on disk), jsonl (what a line must be), upload (multipart
under limits), files and routes (the HTTP faces), runner (the idle-time
lane's loop) over lane and models (its rules), dispatch (a line through the
app itself), finish (validating and writing results), service (the whole,
as the app holds it). docs/batches.md says how it behaves.
"""
