"""Files on disk, beneath every other package: the one write-then-rename protocol (`atomic`), the
one sha256 over a file's bytes (`digest`) and the checked reading of a saved JSON state (`plain_state`)."""
