/* What this container was given, from its environment: one slice per GPU it may see.
 *
 *   GPUPPETTI_VK_SLICES      comma-separated SELECTOR=BYTES: SELECTOR is any, pci:DDDD:BB:DD.F or uuid:<32 hex>;
 *                            BYTES is the slice's memory budget, 0 for a whole GPU (visible, not limited)
 *                            (the heaps and limits the layer reports; the daemon's ledger holds the slice's
 *                            memory to its own budget, whatever this says)
 *   GPUPPETTI_VK_COMPUTE     optional: each slice's share of GPU time (dutycycle.h); a value that does not parse,
 *                            or names more or fewer slices, throttles none (the ledger's share, where it says one,
 *                            is the one held)
 *   GPUPPETTI_VK_LEDGER      the allocation's ledger, a Unix socket (ledger.h); without it, each process alone is
 *                            held to its slices' budgets
 *   GPUPPETTI_VK_LEDGER_WAIT_MS  how long a reservation waits for the ledger while its daemon is away (ledger.h)
 *
 * Without GPUPPETTI_VK_SLICES, or with a value that does not parse, the layer passes everything through.
 */
#ifndef GPUPPETTI_SLICES_H
#define GPUPPETTI_SLICES_H

#include <stdbool.h>
#include <stdint.h>

enum selector_kind { SELECT_ANY, SELECT_PCI, SELECT_UUID };

struct slice {
    enum selector_kind kind;
    uint32_t pci_domain, pci_bus, pci_device, pci_function;
    uint8_t uuid[16];
    int64_t budget;
    int compute; /* thousandths of the GPU's time; 1000: not throttled */
    int index;   /* its place in GPUPPETTI_VK_SLICES: its index in the ledger */
};

struct slices {
    bool active;
    int count;
    struct slice *items; /* count of them, as many as the value names */
};

/* Parse the environment once per process; the result is never changed afterwards. A value that is set but does not
 * parse is said once on stderr. */
const struct slices *slices_get(void);
/* Parse a value of GPUPPETTI_VK_SLICES into slices (no ledger set up); false when it does not parse (or no
 * memory is left for it). slices_free gives back what a parse took. */
bool slices_parse(const char *text, struct slices *out);
void slices_free(struct slices *slices);
/* Parse a value of GPUPPETTI_VK_COMPUTE into slices' compute shares; false (and every share 1000) when it does not
 * parse or does not name exactly one share per slice. */
bool slices_parse_compute(const char *text, struct slices *slices);

#endif
