/**
 * Resolves after `ms`. It calls the global setTimeout when called, not one captured at import, so
 * a test that installs a fake clock drives its sleeps too.
 */
export const sleep = (ms: number): Promise<void> => new Promise((resolve) => setTimeout(resolve, ms))
