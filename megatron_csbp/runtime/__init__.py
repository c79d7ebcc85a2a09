"""What every entry point needs around its work, whatever the work is: one-line refusals and exit statuses
(`entry`), quiet start-up (`quiet`), spawning local ranks (`launch`), publishing files whole by rename
(`publish`), one writer per directory (`save_lock`), and loading files without running code from them
(`safe_load`). Imports only `core`.
"""
