"""``kombu-delay web``: a small dashboard to see and steer what is scheduled, in a browser.

An optional extra (``pip install 'kombu-delay[web]'``: Flask and waitress); the transport and
the mover never import it. :func:`kombu_delay.web.app.create_app` builds the WSGI app over a
:class:`~kombu_delay.control.DelayControl`; :mod:`kombu_delay.web.cli` is the command.
"""
