"""Files on disk, beneath every other package: the one write-then-rename protocol (`atomic`) and the one
sha256 over a file's bytes (`digest`)."""
