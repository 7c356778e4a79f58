/* What this container was given, from its environment: one slice per GPU it may see.
 *
 *   GPUPPETTI_VK_SLICES      comma-separated SELECTOR=BYTES: SELECTOR is any, pci:DDDD:BB:DD.F or uuid:<32 hex>;
 *                            BYTES is the slice's memory budget, 0 for a whole GPU (visible, not limited)
 *   GPUPPETTI_VK_ACCOUNTING  the directory holding slice-<n>.acct, the n-th slice's shared accounting
 *
 *   GPUPPETTI_VK_COMPUTE     optional: each slice's share of GPU time (dutycycle.h); a value that does not parse,
 *                            or names more or fewer slices, throttles none
 *
 * Without GPUPPETTI_VK_SLICES, or with a value that does not parse, the layer passes everything through.
 */
#ifndef GPUPPETTI_SLICES_H
#define GPUPPETTI_SLICES_H

#include <stdbool.h>
#include <stdint.h>

#include "accounting.h"

enum selector_kind { SELECT_ANY, SELECT_PCI, SELECT_UUID };

struct slice {
    enum selector_kind kind;
    uint32_t pci_domain, pci_bus, pci_device, pci_function;
    uint8_t uuid[16];
    int64_t budget;
    int compute; /* thousandths of the GPU's time; 1000: not throttled */
    struct acct acct;
};

struct slices {
    bool active;
    int count;
    struct slice *items; /* count of them, as many as the value names */
};

/* Parse the environment once per process; the result is never changed afterwards. A value that is set but does not
 * parse is said once on stderr. */
const struct slices *slices_get(void);
/* Parse a value of GPUPPETTI_VK_SLICES into slices (no accounting opened); false when it does not parse (or no
 * memory is left for it). slices_free gives back what a parse took. */
bool slices_parse(const char *text, struct slices *out);
void slices_free(struct slices *slices);
/* Parse a value of GPUPPETTI_VK_COMPUTE into slices' compute shares; false (and every share 1000) when it does not
 * parse or does not name exactly one share per slice. */
bool slices_parse_compute(const char *text, struct slices *slices);

#endif
