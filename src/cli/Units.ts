/** The units `swactor run` writes its figures in: milliseconds, MiB/GiB, and a progress bar. */

/** Milliseconds: whole from 100 up, two decimals below. */
export const ms = (value: number) => (value >= 100 ? value.toFixed(0) : value.toFixed(2))

export const mib = (bytes: number) => `${(bytes / 2 ** 20).toFixed(1)} MiB`

export const gib = (bytes: number) => `${(bytes / 2 ** 30).toFixed(1)} GiB`

/** MiB, or KiB below one MiB. */
export const size = (bytes: number) => (bytes < 2 ** 20 ? `${(bytes / 1024).toFixed(1)} KiB` : mib(bytes))

/** A text progress bar: `[####----]`. */
export const bar = (fraction: number, width = 20) => {
  const filled = Math.round(Math.max(0, Math.min(1, fraction)) * width)
  return `[${"#".repeat(filled)}${"-".repeat(width - filled)}]`
}
