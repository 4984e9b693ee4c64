from stream.daemon.cli import entry

entry()
