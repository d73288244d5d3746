"""Imported, for its one effect, by the fork server that starts the command's workers
(:func:`launch.start_method` preloads it there, never elsewhere): the server ignores SIGTERM.
A cluster that ends a job sends SIGTERM to every process of it; the workers then stop after
their current step (:func:`launch._worker`), and the server, which reports their exits to the
command, must outlive them for the command to see them end."""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
