"""lemonkit's tests, one package per package of lemonkit (``tests/server/`` tests ``lemonkit/server/``, ...), the
whole-package checks here at the top, and the helpers they share in ``tests/support/``. A test that goes through a
real server over HTTP lives with the routes or feature it exercises."""
