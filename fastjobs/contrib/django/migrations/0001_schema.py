"""fastjobs' schema up to its migration 005 (fastjobs.contrib.django.schema)."""

from django.db import migrations

from fastjobs.contrib.django.schema import migrate_to


class Migration(migrations.Migration):  # type: ignore[misc]  # django has no type information
    initial = True
    atomic = False  # fastjobs' steps run in their own transactions, index builds outside any
    dependencies: list[tuple[str, str]] = []
    operations = [migrations.RunPython(migrate_to(5), migrations.RunPython.noop, elidable=False)]
