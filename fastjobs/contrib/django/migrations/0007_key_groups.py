"""fastjobs' schema up to its migration 011, keyed claims by key groups (fastjobs.contrib.django.schema)."""

from django.db import migrations

from fastjobs.contrib.django.schema import migrate_to


class Migration(migrations.Migration):  # type: ignore[misc]  # django has no type information
    atomic = False  # fastjobs' steps run in their own transactions, index builds outside any
    dependencies = [("fastjobs", "0006_fair")]
    operations = [migrations.RunPython(migrate_to(11), migrations.RunPython.noop, elidable=False)]
