package migrations

// MigrateWaiting is Migrate with its lock bounds given, for tests.
var MigrateWaiting = migrateWaiting
