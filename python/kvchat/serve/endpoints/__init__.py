"""The server's endpoints, one module per family. Each module's ``register``
adds its routes to the app; they share one ``AppContext``."""
