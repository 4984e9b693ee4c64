"""The daemon around a run: the command line (cli), worker processes per device (supervisor), the control
endpoint (control), HTTP status page, metrics and health (http, status_page), the terminal report (report),
logging and the event loop (logs, loop), process settings (malloc, gpu_memory).
"""
