"""The dashboard's pages, one module each; each has ``routes(web)``, its routes (docs/dashboard.md, "Pages")."""
