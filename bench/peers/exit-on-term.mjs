// Preloaded (node --import) into the idem Node server when the driver takes
// a --cpu-prof: SIGTERM exits normally, so the profile is written.
process.on("SIGTERM", () => process.exit(0));
