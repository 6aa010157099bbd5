class DefaultOnly:
    """Migrations go to "default" only: "lite" is there to be refused by the task backend."""

    def allow_migrate(self, db, app_label, **hints):
        return db == "default"
